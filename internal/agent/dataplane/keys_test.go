package dataplane

import (
	"context"
	"strings"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/token"
	grpcmw "github.com/grpc-ecosystem/go-grpc-middleware/v2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// tokenKeys is keys as a Settings message carries them.
func tokenKeys(keys ...token.SigningKey) []*masterv1.TokenKey {
	out := make([]*masterv1.TokenKey, len(keys))
	for i, k := range keys {
		out[i] = &masterv1.TokenKey{Id: k.ID, Key: k.Secret}
	}
	return out
}

// principalHeader names the SPIFFE id testPrincipal puts in the context.
const principalHeader = "x-test-principal"

// testPrincipal stands in for the agent's authentication interceptor: the
// principal named in principalHeader becomes the call's, as the real one
// makes the verified certificate's.
func testPrincipal(ctx context.Context) (context.Context, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	v := md.Get(principalHeader)
	if len(v) == 0 {
		return ctx, nil
	}
	p, err := auth.ParseSPIFFE(v[0])
	if err != nil {
		return nil, status.Error(codes.Unauthenticated, err.Error())
	}
	return auth.NewContext(ctx, p), nil
}

func startWithPrincipals(t *testing.T) *env {
	return start(t, append(ServerOptions(),
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			ctx, err := testPrincipal(ctx)
			if err != nil {
				return nil, err
			}
			return h(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			ctx, err := testPrincipal(ss.Context())
			if err != nil {
				return err
			}
			return h(srv, &grpcmw.WrappedServerStream{ServerStream: ss, WrappedContext: ctx})
		}))...)
}

func as(ctx context.Context, spiffe string) context.Context {
	if spiffe == "" {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, principalHeader, spiffe)
}

// TestTokenBindings: the agent refuses a token under a key it was not sent,
// for another object than the allocation's, or (for a tenant caller) of
// another tenant; for every entry point (Write, Read, BatchWrite, BatchRead)
// with PermissionDenied INVALID_TOKEN, like a bad signature.
func TestTokenBindings(t *testing.T) {
	e := startWithPrincipals(t)
	ctx := t.Context()
	sealed := e.reserve(t, e.mem, 10)
	if err := e.mem.Seal([]segment.SealArg{{ID: sealed, Checksum: checksum.Sum(make([]byte, 10))}}, now)[0]; err != nil {
		t.Fatal(err)
	}
	seg := e.mem.ID()
	sign := func(k token.SigningKey, mode token.Mode, id uint64, tenant, key string) []byte {
		return token.Sign(k, token.Claims{Mode: mode, Tenant: tenant, Key: key, SegmentID: seg, AllocationID: id, Expiry: now.Add(time.Minute)})
	}
	unknown := token.SigningKey{ID: e.key.ID + 100, Secret: e.key.Secret}
	const tenantT, tenantU, agent = "spiffe://crescent.test/tenant/t", "spiffe://crescent.test/tenant/u", "spiffe://crescent.test/agent/h1"
	tests := []struct {
		name   string
		key    token.SigningKey
		tenant string
		objKey string
		caller string
		ok     bool
		msg    string
	}{
		{"ok", e.key, "t", "k", "", true, ""},
		{"ok, tenant caller", e.key, "t", "k", tenantT, true, ""},
		{"ok, agent caller", e.key, "t", "k", agent, true, ""},
		{"unknown key id", unknown, "t", "k", "", false, "unknown key"},
		{"another tenant's object", e.key, "u", "k", "", false, "names object"},
		{"another key", e.key, "t", "k2", "", false, "names object"},
		{"caller of another tenant", e.key, "t", "k", tenantU, false, "another tenant"},
	}
	for _, tt := range tests {
		check := func(t *testing.T, err error) {
			t.Helper()
			if tt.ok {
				if err != nil {
					t.Fatalf("got %v, want success", err)
				}
				return
			}
			if r, ok := err.(itemError); ok {
				if codes.Code(r.GetCode()) != codes.PermissionDenied || r.GetReason() != "INVALID_TOKEN" || !strings.Contains(r.GetMessage(), tt.msg) {
					t.Fatalf("item: got %v %s %q, want PermissionDenied INVALID_TOKEN saying %q", codes.Code(r.GetCode()), r.GetReason(), r.GetMessage(), tt.msg)
				}
				return
			}
			wantErr(t, err, codes.PermissionDenied, "INVALID_TOKEN")
			if !strings.Contains(status.Convert(err).Message(), tt.msg) {
				t.Fatalf("message %q does not say %q", status.Convert(err).Message(), tt.msg)
			}
		}
		t.Run(tt.name, func(t *testing.T) {
			cctx := as(ctx, tt.caller)
			t.Run("read", func(t *testing.T) {
				_, _, _, err := e.read(cctx, &agentv1.ReadRequest{SegmentId: seg, AllocationId: sealed, Token: sign(tt.key, token.Read, sealed, tt.tenant, tt.objKey)})
				check(t, err)
			})
			t.Run("write", func(t *testing.T) {
				id := e.reserve(t, e.mem, 1)
				_, err := e.write(cctx, &agentv1.WriteHeader{SegmentId: seg, AllocationId: id, Token: sign(tt.key, token.Write, id, tt.tenant, tt.objKey)}, []byte("x"), 1)
				check(t, err)
			})
			t.Run("batch", func(t *testing.T) {
				id := e.reserve(t, e.mem, 1)
				w, err := e.client.BatchWrite(cctx, &agentv1.BatchWriteRequest{Items: []*agentv1.BatchWriteItem{
					{SegmentId: seg, AllocationId: id, Token: sign(tt.key, token.Write, id, tt.tenant, tt.objKey), Data: []byte("x")}}})
				if err != nil {
					t.Fatal(err)
				}
				check(t, itemStatus(w.GetResults()[0]))
				r, err := e.client.BatchRead(cctx, &agentv1.BatchReadRequest{Items: []*agentv1.BatchReadItem{
					{SegmentId: seg, AllocationId: sealed, Token: sign(tt.key, token.Read, sealed, tt.tenant, tt.objKey)}}})
				if err != nil {
					t.Fatal(err)
				}
				check(t, itemStatus(r.GetResults()[0].GetStatus()))
			})
		})
	}
}

// itemError is a failed batch item's result as an error.
type itemError struct{ *agentv1.ItemResult }

func (e itemError) Error() string { return e.GetMessage() }

func itemStatus(r *agentv1.ItemResult) error {
	if r.GetCode() == 0 {
		return nil
	}
	return itemError{r}
}

// TestKeyRotation: after the master's Settings name a new key and the
// previous one, tokens under either are accepted; after the next rotation,
// tokens under the key two rotations old are refused as unknown.
func TestKeyRotation(t *testing.T) {
	e := start(t)
	ctx := t.Context()
	sealed := e.reserve(t, e.mem, 10)
	if err := e.mem.Seal([]segment.SealArg{{ID: sealed, Checksum: checksum.Sum(make([]byte, 10))}}, now)[0]; err != nil {
		t.Fatal(err)
	}
	k0 := e.key
	k1 := token.SigningKey{ID: k0.ID + 1, Secret: token.NewKey()}
	k2 := token.SigningKey{ID: k0.ID + 2, Secret: token.NewKey()}
	read := func(k token.SigningKey) error {
		_, _, _, err := e.read(ctx, &agentv1.ReadRequest{SegmentId: e.mem.ID(), AllocationId: sealed,
			Token: token.Sign(k, token.Claims{Mode: token.Read, Tenant: "t", Key: "k", SegmentID: e.mem.ID(), AllocationID: sealed, Expiry: now.Add(time.Minute)})})
		return err
	}
	e.keys.Set(tokenKeys(k1, k0))
	for _, k := range []token.SigningKey{k0, k1} {
		if err := read(k); err != nil {
			t.Fatalf("after one rotation, key %d: %v", k.ID, err)
		}
	}
	e.keys.Set(tokenKeys(k2, k1))
	if err := read(k0); status.Code(err) != codes.PermissionDenied || !strings.Contains(status.Convert(err).Message(), "unknown key") {
		t.Fatalf("key two rotations old: got %v, want PermissionDenied unknown key", err)
	}
	for _, k := range []token.SigningKey{k1, k2} {
		if err := read(k); err != nil {
			t.Fatalf("after two rotations, key %d: %v", k.ID, err)
		}
	}
	if got := e.keys.KeyIDs(); len(got) != 2 || got[0] != k2.ID || got[1] != k1.ID {
		t.Fatalf("KeyIDs: got %v, want [%d %d]", got, k2.ID, k1.ID)
	}
	// Empty secrets are never keys.
	e.keys.Set([]*masterv1.TokenKey{{Id: 9}})
	if got := e.keys.KeyIDs(); len(got) != 0 {
		t.Fatalf("KeyIDs after a Settings with only an empty key: got %v, want none", got)
	}
}
