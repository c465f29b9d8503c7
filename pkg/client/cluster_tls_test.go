package client_test

import (
	"bytes"
	"fmt"
	"testing"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/xfer"
	"github.com/crescent-kv/crescent/pkg/client"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The SDK against a real cluster with mTLS on every link (testcluster
// Options.TLS): puts and gets of every size on both data paths, and a read
// token that leaks to another tenant opens nothing on the bulk transfer
// listener.
func TestClusterTLS(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{TLS: true})
	for _, transfer := range []bool{true, false} {
		t.Run(pathName(transfer), func(t *testing.T) {
			before := c.Calls("Write") + c.Calls("Read") + c.Calls("BatchWrite") + c.Calls("BatchRead")
			cl := c.Client(t, c.As(auth.RoleTenant, testcluster.TenantA), func(cfg *client.Config) {
				cfg.Tenant, cfg.DisableTransfer, cfg.SmallObject, cfg.ChunkSize = testcluster.TenantA, !transfer, 8<<10, 64<<10
			})
			ctx := t.Context()
			for _, size := range []int{1, 4 << 10, 300 << 10, 3<<20 + 1} {
				key := fmt.Sprintf("%s/%d", pathName(transfer), size)
				data := bytes.Repeat([]byte{byte(size)}, size)
				if err := cl.Put(ctx, key, data, client.WithReplicas(2)); err != nil {
					t.Fatalf("put %d bytes: %v", size, err)
				}
				if got, err := cl.Get(ctx, key); err != nil || !bytes.Equal(got, data) {
					t.Fatalf("get %d bytes: %d bytes, %v", size, len(got), err)
				}
			}
			items := make([]client.Item, 64)
			keys := make([]string, len(items))
			for i := range items {
				keys[i] = fmt.Sprintf("%s/batch-%d", pathName(transfer), i)
				items[i] = client.Item{Key: keys[i], Data: bytes.Repeat([]byte{byte(i)}, 4<<10)}
			}
			for i, err := range cl.BatchPut(ctx, items) {
				if err != nil {
					t.Fatalf("batch put %d: %v", i, err)
				}
			}
			got, errs := cl.BatchGet(ctx, keys)
			for i := range keys {
				if errs[i] != nil || !bytes.Equal(got[i], items[i].Data) {
					t.Fatalf("batch get %d: %v", i, errs[i])
				}
			}
			grpcCalls := c.Calls("Write") + c.Calls("Read") + c.Calls("BatchWrite") + c.Calls("BatchRead") - before
			if transfer != (grpcCalls == 0) {
				t.Fatalf("%d DataService calls on the %s path", grpcCalls, pathName(transfer))
			}
		})
	}

	// The lookups went on the master's lookup listener, over TLS with the
	// tenant's certificate (issue 18); another tenant's key is refused
	// there as on gRPC.
	if st := c.Master().LookupStats(); st.Calls == 0 {
		t.Errorf("no lookup on the lookup listener: %+v", st)
	}
	t.Run("lookup of another tenant", func(t *testing.T) {
		a := c.Client(t, c.As(auth.RoleTenant, testcluster.TenantA), func(cfg *client.Config) { cfg.Tenant = testcluster.TenantA })
		for range 3 {
			if _, err := a.Tenant(testcluster.TenantB).Exist(t.Context(), "k"); status.Code(err) != codes.PermissionDenied {
				t.Fatalf("tenant a's Exist in b: %v, want PERMISSION_DENIED", err)
			}
		}
	})

	t.Run("token of another tenant", func(t *testing.T) {
		ctx := t.Context()
		owner := c.Client(t, c.As(auth.RoleTenant, testcluster.TenantA), func(cfg *client.Config) { cfg.Tenant = testcluster.TenantA })
		data := []byte("tenant a's secret")
		if err := owner.Put(ctx, "secret", data); err != nil {
			t.Fatal(err)
		}
		rl, err := owner.Objects().GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: testcluster.TenantA, Key: "secret"})
		if err != nil {
			t.Fatal(err)
		}
		d := rl.GetReplicas()[0]
		item := func() []*agentv1.TransferItem {
			return []*agentv1.TransferItem{{SegmentId: d.GetSegmentId(), AllocationId: d.GetAllocationId(), Token: d.GetToken()}}
		}
		read := func(tenant string) error {
			p := xfer.NewPool(xfer.Config{TLS: c.ClientTLS(auth.RoleTenant, tenant)})
			defer p.Close()
			res, err := p.Read(ctx, d.GetTransferEndpoint(), item(), [][]byte{make([]byte, len(data))})
			if err != nil {
				return err
			}
			return res[0].Err
		}
		if err := read(testcluster.TenantA); err != nil {
			t.Fatalf("the owner's read with its token: %v", err)
		}
		err = read(testcluster.TenantB)
		if status.Code(err) != codes.PermissionDenied || rpcerr.Reason(err) != "INVALID_TOKEN" {
			t.Fatalf("tenant b's read with tenant a's token = %v, want PermissionDenied INVALID_TOKEN", err)
		}
		// Nor may tenant b ask the master for tenant a's replicas.
		thief := c.Client(t, c.As(auth.RoleTenant, testcluster.TenantB), func(cfg *client.Config) { cfg.Tenant = testcluster.TenantA })
		if _, err := thief.Get(ctx, "secret"); status.Code(err) != codes.PermissionDenied {
			t.Fatalf("tenant b's get of tenant a's key = %v, want PermissionDenied", err)
		}
	})
}
