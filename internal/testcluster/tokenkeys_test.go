package testcluster_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	masterapp "github.com/crescent-kv/crescent/internal/master/app"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// TestTokenKeyRotation: a master that rotates its token key every 2 s
// (tokens live 0.8 s) while puts and gets run, single and batched, through
// both data paths (bulk transfer and gRPC): no operation fails, and a
// token signed two rotations ago is refused by a real agent as signed by an
// unknown key.
func TestTokenKeyRotation(t *testing.T) {
	const rotation = 2 * time.Second
	c := testcluster.Start(t, testcluster.Options{Master: func(cfg *masterapp.Config) {
		cfg.TokenKeyRotation = rotation
		cfg.LeaseTTL = 800 * time.Millisecond
		cfg.WriteTokenTTL = 800 * time.Millisecond
	}})
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	ring := c.Master().Identity.Keys
	first := ring.Keys()[0].ID

	// A read token signed under the first key, for later.
	seed := c.Client(t)
	if err := seed.Put(ctx, "seed", []byte("seed")); err != nil {
		t.Fatal(err)
	}
	old, err := masterv1.NewObjectServiceClient(c.Conn()).GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Key: "seed"})
	if err != nil {
		t.Fatal(err)
	}

	clients := map[string]*client.Client{
		"xfer": c.Client(t),
		"grpc": c.Client(t, func(cfg *client.Config) { cfg.DisableTransfer = true }),
	}
	var ops, fails atomic.Int64
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for name, cl := range clients {
		wg.Go(func() {
			data := bytes.Repeat([]byte(name), 1024)
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("%s-%d", name, i)
				if err := cl.Put(ctx, key, data); err != nil {
					fails.Add(1)
					t.Errorf("%s: Put %s: %v", name, key, err)
				} else if got, err := cl.Get(ctx, key); err != nil || !bytes.Equal(got, data) {
					fails.Add(1)
					t.Errorf("%s: Get %s: %d bytes, %v", name, key, len(got), err)
				}
				items := make([]client.Item, 8)
				keys := make([]string, len(items))
				for j := range items {
					keys[j] = fmt.Sprintf("%s-%d-b%d", name, i, j)
					items[j] = client.Item{Key: keys[j], Data: data[:512]}
				}
				for j, err := range cl.BatchPut(ctx, items) {
					if err != nil {
						fails.Add(1)
						t.Errorf("%s: BatchPut %s: %v", name, keys[j], err)
					}
				}
				got, errs := cl.BatchGet(ctx, keys)
				for j, err := range errs {
					if err != nil || !bytes.Equal(got[j], data[:512]) {
						fails.Add(1)
						t.Errorf("%s: BatchGet %s: %d bytes, %v", name, keys[j], len(got[j]), err)
					}
				}
				ops.Add(4)
			}
		})
	}
	// Three rotations, then a little past the last one's activation.
	testutil.Eventually(t, 30*time.Second, func() bool { return ring.Keys()[0].ID-first >= 3 }, "three token key rotations")
	time.Sleep(rotation / 10)
	close(stop)
	wg.Wait()
	if ops.Load() == 0 || fails.Load() > 0 {
		t.Fatalf("%d of %d operations failed across %d rotations", fails.Load(), ops.Load(), ring.Keys()[0].ID-first)
	}
	t.Logf("%d operations, none failed, across %d key rotations", ops.Load(), ring.Keys()[0].ID-first)

	// The first key is two or more rotations old: agents no longer know it.
	d := old.GetReplicas()[0]
	cc, err := grpc.NewClient(d.GetDataEndpoint(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	st, err := agentv1.NewDataServiceClient(cc).Read(ctx, &agentv1.ReadRequest{SegmentId: d.GetSegmentId(), AllocationId: d.GetAllocationId(), Token: d.GetToken()})
	if err == nil {
		_, err = st.Recv()
	}
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(status.Convert(err).Message(), "unknown key") {
		t.Fatalf("read with a token two rotations old: got %v, want PermissionDenied (unknown key)", err)
	}
}
