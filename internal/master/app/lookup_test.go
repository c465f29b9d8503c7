package app

import (
	"bufio"
	"crypto/tls"
	"net"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/auth/devcerts"
	"github.com/crescent-kv/crescent/internal/fastcall"
	"github.com/crescent-kv/crescent/internal/master/objectsvc"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/xfer"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// lookupConn is a raw connection to a master's lookup listener.
type lookupConn struct {
	nc  net.Conn
	br  *bufio.Reader
	pre bool
}

func dialLookup(t *testing.T, addr string, tc *tls.Config) *lookupConn {
	t.Helper()
	nc, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if tc != nil {
		nc = tls.Client(nc, tc)
	}
	t.Cleanup(func() { nc.Close() })
	_ = nc.SetDeadline(time.Now().Add(10 * time.Second))
	return &lookupConn{nc: nc, br: bufio.NewReader(nc)}
}

// call makes one call; the error is the answer's status, or the
// connection's failure.
func (c *lookupConn) call(m *masterv1.CallStreamRequest) (*masterv1.CallStreamResponse, error) {
	var b []byte
	if !c.pre {
		b, c.pre = append(b, fastcall.Preamble...), true
	}
	b, err := fastcall.AppendFrame(b, m, fastcall.MaxRequest)
	if err != nil {
		return nil, err
	}
	if _, err := c.nc.Write(b); err != nil {
		return nil, err
	}
	in, err := fastcall.ReadFrame(c.br, nil, fastcall.MaxResponse)
	if err != nil {
		return nil, err
	}
	r := &masterv1.CallStreamResponse{}
	if err := r.UnmarshalVT(in); err != nil {
		return nil, err
	}
	return r, status.ErrorProto(&spb.Status{Code: r.GetCode(), Message: r.GetMessage(), Details: r.GetDetails()})
}

// TestLookupListenerAuthorization: the lookup listener (issue 18) answers
// calls as CallStream does, under the rules of issue 14: a tenant's
// certificate admits its own lookups and no other tenant's, roles that may
// not look up are refused, a client without a certificate is
// unauthenticated, and a plaintext client gets no answer. CallStream
// names the listener.
func TestLookupListenerAuthorization(t *testing.T) {
	dir := t.TempDir()
	if err := devcerts.Init(dir, devcerts.Options{Tenants: []string{"a", "b"}}); err != nil {
		t.Fatal(err)
	}
	m, _ := secureMasterApp(t, dir)
	testutil.Eventually(t, 10*time.Second, func() bool { return m.LookupAddr() != "" }, "the lookup listener")
	addr := m.LookupAddr()
	_, port, _ := net.SplitHostPort(addr)

	// CallStream names it.
	var hdr metadata.MD
	st, err := masterv1.NewObjectServiceClient(conn(t, dir, m.Server.GRPCAddr(), auth.RoleTenant, "a")).CallStream(t.Context(), grpc.Header(&hdr))
	if err != nil {
		t.Fatal(err)
	}
	if hdr, err = st.Header(); err != nil {
		t.Fatal(err)
	}
	if got := hdr.Get(objectsvc.LookupAddrHeader); len(got) != 1 || got[0] != ":"+port {
		t.Fatalf("CallStream names %q, want :%s", got, port)
	}
	_ = st.CloseSend()

	as := func(role auth.Role, name string) *tls.Config {
		return xfer.ClientTLS(clientSource(t, dir, role, name).ClientTLSExpect("", masterIdentity), addr)
	}
	a := dialLookup(t, addr, as(auth.RoleTenant, "a"))
	if _, err := a.call(carriedLookup(1, "a")); err != nil {
		t.Errorf("tenant a's lookup: %v", err)
	}
	if _, err := a.call(carriedLookup(2, "a", "b")); status.Code(err) != codes.PermissionDenied {
		t.Errorf("tenant a naming b: %v, want PERMISSION_DENIED", err)
	}
	putB := &masterv1.CallStreamRequest{RequestId: 3, Call: &masterv1.CallStreamRequest_PutStart{
		PutStart: &masterv1.PutStartRequest{Tenant: "b", Key: "k", Size: 1, ClientId: "c"}}}
	if _, err := a.call(putB); status.Code(err) != codes.PermissionDenied {
		t.Errorf("tenant a's PutStart into b: %v, want PERMISSION_DENIED", err)
	}
	if r, err := a.call(carriedLookup(4, "a")); err != nil || r.GetRequestId() != 4 {
		t.Errorf("after refused calls the connection serves: %v (request id %d)", err, r.GetRequestId())
	}
	for _, role := range []auth.Role{auth.RoleAgent, auth.RoleGateway} {
		c := dialLookup(t, addr, as(role, string(role)+"-1"))
		if _, err := c.call(carriedLookup(1, "a")); status.Code(err) != codes.PermissionDenied {
			t.Errorf("%s's lookup: %v, want PERMISSION_DENIED", role, err)
		}
	}
	anon := dialLookup(t, addr, as(auth.RoleTenant, ""))
	if _, err := anon.call(carriedLookup(1, "a")); status.Code(err) != codes.Unauthenticated {
		t.Errorf("a client without a certificate: %v, want UNAUTHENTICATED", err)
	}
	plain := dialLookup(t, addr, nil)
	if r, err := plain.call(carriedLookup(1, "a")); r != nil || err == nil {
		t.Errorf("a plaintext client got an answer: %v, %v", r, err)
	}
	// A connection that breaks the protocol is dropped, others serve on.
	bad := dialLookup(t, addr, as(auth.RoleTenant, "a"))
	if _, err := bad.nc.Write([]byte(strings.Repeat("x", 64))); err != nil {
		t.Fatal(err)
	}
	if _, err := bad.br.ReadByte(); err == nil {
		t.Error("a bad preamble: the connection stayed")
	}
	if _, err := a.call(carriedLookup(5, "a")); err != nil {
		t.Errorf("after another connection's violation: %v", err)
	}
}
