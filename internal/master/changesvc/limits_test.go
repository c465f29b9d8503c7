package changesvc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// TestSnapshotConcurrencyCap: Snapshot streams whose clients stop reading
// hold their copy of the readable set; past MaxSnapshots a new one fails at
// once with RESOURCE_EXHAUSTED / LIMIT_EXCEEDED, and once a stalled client
// goes a full snapshot is served again, in bounded pages.
func TestSnapshotConcurrencyCap(t *testing.T) {
	c := metatest.NewCluster(1, 1, 1<<30)
	store, err := meta.New(meta.Config{Shards: 8}, meta.Deps{
		Registry: c.Reg, Agents: c.Agents, Identity: cluster.Identity{Epoch: 77, Keys: token.NewRing(0, nil)},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{store: store}
	const n = 3000 // 3000 × 200-byte keys: far past a stream's flow-control window
	for i := range n {
		h.put(t, "t", fmt.Sprintf("%04d%s", i, strings.Repeat("k", 196)))
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(rpccodec.ServerOption())
	New(Config{SnapshotPageSize: 100, MaxSnapshots: 2}, store).Register(gs)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = gs.Serve(lis)
	}()
	cc, err := grpc.NewClient(lis.Addr().String(), rpccodec.DialOption(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cc.Close()
		gs.Stop()
		<-done
	})
	cli := masterv1.NewChangeServiceClient(cc)

	stalled := make([]context.CancelFunc, 2)
	for i := range stalled {
		ctx, cancel := context.WithCancel(t.Context())
		stalled[i] = cancel
		defer cancel()
		ss, err := cli.Snapshot(ctx, &masterv1.SnapshotRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ss.Recv(); err != nil { // the handler holds its slot now
			t.Fatal(err)
		}
	}
	ss, err := cli.Snapshot(t.Context(), &masterv1.SnapshotRequest{})
	if err == nil {
		_, err = ss.Recv()
	}
	if status.Code(err) != codes.ResourceExhausted || rpcerr.Reason(err) != "LIMIT_EXCEEDED" {
		t.Fatalf("third snapshot: got %v, want RESOURCE_EXHAUSTED / LIMIT_EXCEEDED", err)
	}

	stalled[0]()
	// The slot frees when the cancelled handler returns; poll until then.
	var got, pages int
	testutil.EventuallyNoError(t, 5*time.Second, func() error {
		var err error
		got, pages, err = readSnapshot(t, cli)
		if err != nil && rpcerr.Reason(err) != "LIMIT_EXCEEDED" {
			t.Fatalf("snapshot after a stalled client left: %v", err)
		}
		return err
	})
	if got != n || pages != n/100 {
		t.Fatalf("snapshot after a stalled client left: %d entries in %d pages, want %d in %d", got, pages, n, n/100)
	}
}

func readSnapshot(t *testing.T, cli masterv1.ChangeServiceClient) (entries, pages int, err error) {
	ss, err := cli.Snapshot(t.Context(), &masterv1.SnapshotRequest{})
	if err != nil {
		return 0, 0, err
	}
	for {
		p, err := ss.Recv()
		if errors.Is(err, io.EOF) {
			return entries, pages, nil
		}
		if err != nil {
			return 0, 0, err
		}
		if len(p.GetEntries()) > 100 {
			t.Fatalf("page of %d entries, over SnapshotPageSize 100", len(p.GetEntries()))
		}
		entries += len(p.GetEntries())
		pages++
	}
}
