package app

import (
	"context"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func carriedLookup(id uint64, tenants ...string) *masterv1.CallStreamRequest {
	req := &masterv1.BatchGetReplicaListRequest{}
	for _, tn := range tenants {
		req.Items = append(req.Items, &masterv1.GetReplicaListRequest{Tenant: tn, Key: "secret"})
	}
	return &masterv1.CallStreamRequest{RequestId: id, Call: &masterv1.CallStreamRequest_BatchGetReplicaList{BatchGetReplicaList: req}}
}

// call sends one carried call and returns its answer's status.
func call(t *testing.T, st masterv1.ObjectService_CallStreamClient, m *masterv1.CallStreamRequest) error {
	t.Helper()
	if err := st.Send(m); err != nil {
		t.Fatal(err)
	}
	r, err := st.Recv()
	if err != nil {
		t.Fatalf("request %d: the stream ended: %v", m.GetRequestId(), err)
	}
	if r.GetRequestId() != m.GetRequestId() {
		t.Fatalf("request %d answered as %d", m.GetRequestId(), r.GetRequestId())
	}
	return status.ErrorProto(&spb.Status{Code: r.GetCode(), Message: r.GetMessage(), Details: r.GetDetails()})
}

// TestCallStreamAuthorization (issue 14's rules on issue 18's stream): a
// tenant's carried calls are authorized one by one as its unary calls are
// (another tenant's keys refused, the stream kept), by certificate or
// bearer token; roles that may not make them cannot open the stream.
func TestCallStreamAuthorization(t *testing.T) {
	dir := t.TempDir()
	if err := devcerts.Init(dir, devcerts.Options{Tenants: []string{"a", "b"}}); err != nil {
		t.Fatal(err)
	}
	addr, _ := secureMaster(t, dir)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	for _, who := range []struct {
		name string
		cc   *grpc.ClientConn
	}{
		{"certificate", conn(t, dir, addr, auth.RoleTenant, "a")},
		{"token", conn(t, dir, addr, auth.RoleTenant, "", grpc.WithPerRPCCredentials(auth.BearerCredentials(tenantAToken)))},
	} {
		st, err := masterv1.NewObjectServiceClient(who.cc).CallStream(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := call(t, st, carriedLookup(1, "a")); err != nil {
			t.Errorf("%s: tenant a's lookup: %v", who.name, err)
		}
		if err := call(t, st, carriedLookup(2, "a", "b")); status.Code(err) != codes.PermissionDenied {
			t.Errorf("%s: tenant a naming b: %v, want PERMISSION_DENIED", who.name, err)
		}
		if err := call(t, st, carriedLookup(3, "a")); err != nil {
			t.Errorf("%s: after a refused call the stream serves: %v", who.name, err)
		}
		putB := &masterv1.CallStreamRequest{RequestId: 4, Call: &masterv1.CallStreamRequest_PutStart{
			PutStart: &masterv1.PutStartRequest{Tenant: "b", Key: "k", Size: 1, ClientId: "c"}}}
		if err := call(t, st, putB); status.Code(err) != codes.PermissionDenied {
			t.Errorf("%s: tenant a's PutStart into b: %v, want PERMISSION_DENIED", who.name, err)
		}
		_ = st.CloseSend()
	}
	admin := conn(t, dir, addr, auth.RoleAdmin, "admin")
	st, err := masterv1.NewObjectServiceClient(admin).CallStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := call(t, st, carriedLookup(1, "a", "b")); err != nil {
		t.Errorf("admin: %v", err)
	}
	for _, role := range []auth.Role{auth.RoleAgent, auth.RoleGateway} {
		st, err := masterv1.NewObjectServiceClient(conn(t, dir, addr, role, string(role)+"-1")).CallStream(ctx)
		if err == nil {
			_ = st.Send(carriedLookup(1, "a"))
			_, err = st.Recv()
		}
		if status.Code(err) != codes.PermissionDenied {
			t.Errorf("%s opening the stream: %v, want PERMISSION_DENIED", role, err)
		}
	}
}

// TestCallStreamGatesAndShutdown: carried calls meet the recovery gate as
// unary calls do (MASTER_RECOVERING per call, the stream kept), and a
// master that stops ends its streams with MASTER_SHUTTING_DOWN at once
// instead of waiting for them until its hard-stop timeout.
func TestCallStreamGatesAndShutdown(t *testing.T) {
	cfg := DefaultConfig()
	cfg.GRPCAddr, cfg.AdminAddr = "127.0.0.1:0", "127.0.0.1:0"
	cfg.RecoveryGrace = time.Second
	cfg.ShutdownTimeout = 30 * time.Second
	r := runMaster(t, cfg)
	cc := r.cc
	st, err := masterv1.NewObjectServiceClient(cc).CallStream(t.Context(), grpc.WaitForReady(true))
	if err != nil {
		t.Fatal(err)
	}
	if err := call(t, st, carriedLookup(1, "t")); rpcerr.Reason(err) != "MASTER_RECOVERING" {
		t.Fatalf("a carried call right after start: %v, want MASTER_RECOVERING", err)
	}
	id := uint64(1)
	testutil.EventuallyNoError(t, 10*time.Second, func() error {
		id++
		return call(t, st, carriedLookup(id, "t"))
	})
	start := time.Now()
	r.cancel()
	if _, err := st.Recv(); rpcerr.Reason(err) != "MASTER_SHUTTING_DOWN" {
		t.Errorf("the stream when the master stops: %v, want MASTER_SHUTTING_DOWN", err)
	}
	r.stop(t, 20*time.Second)
	// Under its ShutdownTimeout (30 s): the open stream did not hold the
	// graceful stop.
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("shutdown took %v with a stream open", d)
	}
}
