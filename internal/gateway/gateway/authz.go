package gateway

import (
	gatewayv1 "github.com/crescent-kv/crescent/gen/crescent/gateway/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"google.golang.org/grpc"
)

// statusRoles may read the gateway's status (GatewayService.GetStatus and
// GET /kv_events/status on the admin port): admins, gateways (a peer or a
// sidecar checking another) and tenants. The status is aggregate counters
// and stream positions, no key and no tenant's data, so every client role
// may see whether the event stream it consumes is healthy; agents have no
// use for it.
var statusRoles = []auth.Role{auth.RoleAdmin, auth.RoleGateway, auth.RoleTenant}

// authTable is the gateway's authorization table (issue 14), enforced with
// TLS by its server's Authorizer, default deny. The ZMQ endpoints (PUB,
// replay, snapshot) are not gRPC and stay plaintext: docs/OPERATIONS.md.
func authTable() auth.Table {
	return auth.Table{
		gatewayv1.GatewayService_GetStatus_FullMethodName: {Roles: statusRoles},
	}
}

// authServices are the services authTable covers, as registered by New.
var authServices = []*grpc.ServiceDesc{&gatewayv1.GatewayService_ServiceDesc}
