package app

import (
	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"google.golang.org/grpc"
)

// authTable is the agent's authorization table (issue 14), enforced with
// TLS by the DataService server's Authorizer, default deny. Every
// DataService call needs an authenticated principal of any role (clients
// of every tenant, other agents copying replicas); what it may touch is
// decided by the capability token the master signed for that allocation,
// which binds tenant, replica, operation and expiry.
func authTable() auth.Table {
	data := auth.Rule{Any: true}
	return auth.Table{
		agentv1.DataService_Write_FullMethodName:      data,
		agentv1.DataService_Read_FullMethodName:       data,
		agentv1.DataService_BatchWrite_FullMethodName: data,
		agentv1.DataService_BatchRead_FullMethodName:  data,
		// Verify: a read token for each item, as Read.
		agentv1.DataService_Verify_FullMethodName: data,
	}
}

// authServices are the services authTable covers, as registered by Run.
var authServices = []*grpc.ServiceDesc{&agentv1.DataService_ServiceDesc}
