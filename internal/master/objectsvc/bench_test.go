package objectsvc

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"github.com/crescent-kv/crescent/internal/master/meta/metatest"
	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/obs/tracing"
	"github.com/crescent-kv/crescent/internal/server"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// benchServer runs the production server bootstrap (internal/server: health,
// reflection, tracing, recovery, logging and metrics interceptors) on
// loopback with an ObjectService over fake agents that keep their
// allocation tables; the client is traced as pkg/client's are.
func benchServer(b *testing.B) (*grpc.ClientConn, *meta.Store) {
	b.Helper()
	c := metatest.NewCluster(4, 2, 1<<50)
	store, err := meta.New(meta.Config{}, meta.Deps{Registry: c.Reg, Agents: c.Agents,
		Identity: cluster.Identity{Epoch: 1, Keys: token.NewRingWithKey(tokenKey)}}, nil)
	if err != nil {
		b.Fatal(err)
	}
	lg := testutil.Logger()
	srv := server.New(server.Config{GRPCAddr: "127.0.0.1:0", ShutdownTimeout: time.Second}, lg, obs.NewRegistry())
	New(Config{}, store).Register(srv.GRPC)
	if err := srv.Listen(); err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	cc, err := grpc.NewClient(srv.GRPCAddr(), grpc.WithTransportCredentials(insecure.NewCredentials()), tracing.DialOption())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		cc.Close()
		cancel()
		<-done
	})
	return cc, store
}

var keySeq atomic.Uint64

func nextKey() string { return fmt.Sprintf("bench/%016x", keySeq.Add(1)) }

// parallel runs f from 8 client goroutines and reports keys/s.
func parallel(b *testing.B, keysPerOp int, f func(ctx context.Context) error) {
	b.Helper()
	b.SetParallelism(4)
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		ctx := context.Background()
		for pb.Next() {
			if err := f(ctx); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.ReportMetric(float64(b.N*keysPerOp)/b.Elapsed().Seconds(), "keys/s")
}

func BenchmarkEmptyUnaryBaseline(b *testing.B) {
	cc, _ := benchServer(b)
	hc := healthpb.NewHealthClient(cc)
	parallel(b, 1, func(ctx context.Context) error {
		_, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
		return err
	})
}

func BenchmarkPutStartEnd(b *testing.B) {
	cc, _ := benchServer(b)
	cli := masterv1.NewObjectServiceClient(cc)
	parallel(b, 1, func(ctx context.Context) error {
		k := nextKey()
		if _, err := cli.PutStart(ctx, &masterv1.PutStartRequest{Key: k, Size: 4096, ClientId: "w"}); err != nil {
			return err
		}
		_, err := cli.PutEnd(ctx, &masterv1.PutEndRequest{Key: k, ClientId: "w", Checksum: 1})
		return err
	})
}

func BenchmarkPutStartEndBatch128(b *testing.B) {
	cc, _ := benchServer(b)
	cli := masterv1.NewObjectServiceClient(cc)
	parallel(b, 128, func(ctx context.Context) error {
		starts := make([]*masterv1.PutStartRequest, 128)
		ends := make([]*masterv1.PutEndRequest, 128)
		for i := range starts {
			k := nextKey()
			starts[i] = &masterv1.PutStartRequest{Key: k, Size: 4096, ClientId: "w"}
			ends[i] = &masterv1.PutEndRequest{Key: k, ClientId: "w", Checksum: 1}
		}
		sr, err := cli.BatchPutStart(ctx, &masterv1.BatchPutStartRequest{Items: starts})
		if err != nil {
			return err
		}
		if st := sr.Results[0].Status; st.Code != 0 {
			return fmt.Errorf("put start: %s", st.Message)
		}
		er, err := cli.BatchPutEnd(ctx, &masterv1.BatchPutEndRequest{Items: ends})
		if err != nil {
			return err
		}
		if st := er.Results[0]; st.Code != 0 {
			return fmt.Errorf("put end: %s", st.Message)
		}
		return nil
	})
}

// loadObjects stores n single-replica objects and returns their keys.
func loadObjects(b *testing.B, store *meta.Store, n int) []string {
	b.Helper()
	keys := make([]string, n)
	specs := make([]meta.PutSpec, n)
	ends := make([]meta.PutEndSpec, n)
	for i := range keys {
		keys[i] = nextKey()
		specs[i] = meta.PutSpec{Key: keys[i], Size: 4096, ClientID: "w"}
		ends[i] = meta.PutEndSpec{Key: keys[i], ClientID: "w", Checksum: 1}
	}
	for _, r := range store.BatchPutStart(context.Background(), specs) {
		if r.Err != nil {
			b.Fatal(r.Err)
		}
	}
	for _, err := range store.BatchPutEnd(context.Background(), ends) {
		if err != nil {
			b.Fatal(err)
		}
	}
	return keys
}

func BenchmarkGetReplicaList(b *testing.B) {
	cc, store := benchServer(b)
	cli := masterv1.NewObjectServiceClient(cc)
	keys := loadObjects(b, store, 1<<14)
	var i atomic.Uint64
	parallel(b, 1, func(ctx context.Context) error {
		k := keys[i.Add(1)%uint64(len(keys))]
		_, err := cli.GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Key: k})
		return err
	})
}

func BenchmarkGetReplicaListBatch128(b *testing.B) {
	cc, store := benchServer(b)
	cli := masterv1.NewObjectServiceClient(cc)
	keys := loadObjects(b, store, 1<<14)
	var i atomic.Uint64
	parallel(b, 128, func(ctx context.Context) error {
		items := make([]*masterv1.GetReplicaListRequest, 128)
		base := i.Add(128)
		for j := range items {
			items[j] = &masterv1.GetReplicaListRequest{Key: keys[(base+uint64(j))%uint64(len(keys))]}
		}
		resp, err := cli.BatchGetReplicaList(ctx, &masterv1.BatchGetReplicaListRequest{Items: items})
		if err != nil {
			return err
		}
		if st := resp.Results[0].Status; st.Code != 0 {
			return fmt.Errorf("get: %s", st.Message)
		}
		return nil
	})
}
