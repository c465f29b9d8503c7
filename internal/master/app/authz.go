package app

import (
	"context"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// authTable is the master's authorization table (issue 14), enforced with
// TLS by the server's one Authorizer, default deny: a method missing here
// is refused to everyone (TestAuthTableCoversEveryMethod fails first).
//
//   - ObjectService: tenants, for their own tenant only (Tenant: the
//     request's tenant, or every item's in a Batch*, must be the caller's;
//     "" is "default"), and admins for any tenant. RemoveAll is audited,
//     and with force is admin only (removeAllForce). Copy, Move and
//     Prefetch are the tenant's, on its own keys.
//     PutEnd and BatchPutEnd may carry seal receipts (issue 18 item 2):
//     the tenant relays them but cannot make one (they are MACed under a
//     key derived from the master's token key, which only agents hold),
//     and the store checks each against the put's own replicas, size,
//     checksum and epoch (meta/receipt.go), so the rule stays own.
//   - AdminService: admins only; the mutating calls are audited (among
//     them CopyObjects and MoveObjects, Copy and Move for any tenant).
//   - SegmentService: agents only (the session binds the stream to the
//     host id of the certificate).
//   - ChangeService: gateways and admins.
func authTable() auth.Table {
	own := auth.Rule{Roles: []auth.Role{auth.RoleTenant, auth.RoleAdmin}, Tenant: true}
	audited := own
	audited.Audit = true
	admin := auth.Rule{Roles: []auth.Role{auth.RoleAdmin}}
	adminAudit := auth.Rule{Roles: []auth.Role{auth.RoleAdmin}, Audit: true}
	return auth.Table{
		masterv1.ObjectService_PutStart_FullMethodName:            own,
		masterv1.ObjectService_PutEnd_FullMethodName:              own,
		masterv1.ObjectService_PutRevoke_FullMethodName:           own,
		masterv1.ObjectService_BatchPutStart_FullMethodName:       own,
		masterv1.ObjectService_BatchPutEnd_FullMethodName:         own,
		masterv1.ObjectService_BatchPutRevoke_FullMethodName:      own,
		masterv1.ObjectService_GetReplicaList_FullMethodName:      own,
		masterv1.ObjectService_BatchGetReplicaList_FullMethodName: own,
		// The roles that may make the calls it carries; each call is then
		// authorized by its own rule, its tenant included (objectsvc).
		masterv1.ObjectService_CallStream_FullMethodName:     {Roles: []auth.Role{auth.RoleTenant, auth.RoleAdmin}},
		masterv1.ObjectService_Exist_FullMethodName:          own,
		masterv1.ObjectService_BatchExist_FullMethodName:     own,
		masterv1.ObjectService_GetSize_FullMethodName:        own,
		masterv1.ObjectService_QueryRoute_FullMethodName:     own,
		masterv1.ObjectService_ListObjects_FullMethodName:    own,
		masterv1.ObjectService_Remove_FullMethodName:         own,
		masterv1.ObjectService_BatchRemove_FullMethodName:    own,
		masterv1.ObjectService_RemoveAll_FullMethodName:      audited,
		masterv1.ObjectService_RemoveByPrefix_FullMethodName: own,
		masterv1.ObjectService_RemoveByRegex_FullMethodName:  own,
		masterv1.ObjectService_Copy_FullMethodName:           own,
		masterv1.ObjectService_Move_FullMethodName:           own,
		masterv1.ObjectService_Prefetch_FullMethodName:       own,

		masterv1.AdminService_ListSegments_FullMethodName:     admin,
		masterv1.AdminService_GetSegment_FullMethodName:       admin,
		masterv1.AdminService_ListAgents_FullMethodName:       admin,
		masterv1.AdminService_DrainSegment_FullMethodName:     adminAudit,
		masterv1.AdminService_UndrainSegment_FullMethodName:   adminAudit,
		masterv1.AdminService_SetTenantQuota_FullMethodName:   adminAudit,
		masterv1.AdminService_GetTenantQuota_FullMethodName:   admin,
		masterv1.AdminService_ListTenants_FullMethodName:      admin,
		masterv1.AdminService_GetClusterStatus_FullMethodName: admin,
		masterv1.AdminService_CopyObjects_FullMethodName:      adminAudit,
		masterv1.AdminService_MoveObjects_FullMethodName:      adminAudit,

		masterv1.SegmentService_Connect_FullMethodName: {Roles: []auth.Role{auth.RoleAgent}},
		masterv1.SegmentService_Follow_FullMethodName:  {Roles: []auth.Role{auth.RoleAgent}},

		masterv1.ChangeService_Watch_FullMethodName:    {Roles: []auth.Role{auth.RoleGateway, auth.RoleAdmin}},
		masterv1.ChangeService_Snapshot_FullMethodName: {Roles: []auth.Role{auth.RoleGateway, auth.RoleAdmin}},
	}
}

// authServices are the services authTable covers, as registered by New.
var authServices = []*grpc.ServiceDesc{
	&masterv1.ObjectService_ServiceDesc, &masterv1.AdminService_ServiceDesc,
	&masterv1.SegmentService_ServiceDesc, &masterv1.ChangeService_ServiceDesc,
}

// removeAllForce refuses RemoveAll with force to everyone but admins: force
// removes objects other clients hold leases on, which a tenant may not
// impose. It runs after the Authorizer, which has put the principal in ctx
// (auth.InsecurePrincipal, an admin, in plaintext) and audits the outcome.
func removeAllForce(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if r, ok := req.(*masterv1.RemoveAllRequest); ok && r.GetForce() && info.FullMethod == masterv1.ObjectService_RemoveAll_FullMethodName {
		if p, _ := auth.FromContext(ctx); p.Role != auth.RoleAdmin {
			return nil, status.Errorf(codes.PermissionDenied, "auth: %s may not call RemoveAll with force: admin only", p)
		}
	}
	return handler(ctx, req)
}
