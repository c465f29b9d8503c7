package client

import (
	"context"
	"errors"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestChunkWrites(t *testing.T) {
	mk := func(sizes ...int) []write {
		ws := make([]write, len(sizes))
		for i, s := range sizes {
			ws[i] = write{item: i, data: make([]byte, s)}
		}
		return ws
	}
	tests := []struct {
		name string
		in   []write
		want []int // chunk lengths
	}{
		{"empty", nil, nil},
		{"one", mk(10), []int{1}},
		{"by count", mk(make([]int, maxBatchItems+1)...), []int{maxBatchItems, 1}},
		{"by bytes", mk(maxBatchBytes/2, maxBatchBytes/2, 1), []int{2, 1}},
		{"oversized item alone", mk(maxBatchBytes+1, 1), []int{1, 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := chunkWrites(tt.in)
			if len(got) != len(tt.want) {
				t.Fatalf("got %d chunks, want %d", len(got), len(tt.want))
			}
			for i := range got {
				if len(got[i]) != tt.want[i] {
					t.Fatalf("chunk %d: got %d items, want %d", i, len(got[i]), tt.want[i])
				}
			}
		})
	}
}

func TestOrderReplicasLocalFirst(t *testing.T) {
	c := &Client{s: &shared{cfg: Config{HostID: "h2"}}}
	reps := []*masterv1.ReplicaDescriptor{{ReplicaId: 1, HostId: "h1"}, {ReplicaId: 2, HostId: "h3"}, {ReplicaId: 3, HostId: "h2"}}
	c.orderReplicas(reps)
	var got []uint32
	for _, r := range reps {
		got = append(got, r.GetReplicaId())
	}
	if want := []uint32{3, 1, 2}; got[0] != want[0] || got[1] != want[1] || got[2] != want[2] {
		t.Fatalf("got order %v, want %v", got, want)
	}
}

func TestErrorsMatchReasons(t *testing.T) {
	wire := rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_HAS_LEASE, "leased"))
	err := rpcerr.FromStatus(wire)
	if !errors.Is(err, ErrLeased) || errors.Is(err, ErrNotFound) {
		t.Fatalf("errors.Is: leased=%v notfound=%v", errors.Is(err, ErrLeased), errors.Is(err, ErrNotFound))
	}
	tests := []struct {
		err  error
		want bool
	}{
		{rpcerr.FromStatus(status.Error(codes.Unavailable, "transport")), true},
		{rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "x"), true},
		{rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_REPLICA_IS_NOT_READY, "x"), false},
		{rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "x"), false},
		{errors.New("plain"), false},
	}
	for _, tt := range tests {
		if v, _ := classify(tt.err, false); (v != final) != tt.want {
			t.Errorf("classify(%v) = %v, want retried=%v", tt.err, v, tt.want)
		}
	}
}

func TestPutOptions(t *testing.T) {
	o := newPutOptions(nil, []PutOption{WithReplicas(3), WithMedium(masterv1.Medium_MEDIUM_DISK), WithSoftPin(time.Hour),
		WithHardPin(), WithGroup("g"), WithUpsert(), WithPreferredSegments("s1"), WithPreferLocal("h")})
	c := o.cfg
	if c.GetReplicaNum() != 3 || c.GetMedium() != masterv1.Medium_MEDIUM_DISK || !c.GetSoftPin() || c.GetSoftPinTtl().AsDuration() != time.Hour ||
		!c.GetHardPin() || c.GetGroupId() != "g" || !o.upsert || c.GetPreferredSegments()[0] != "s1" || c.GetPreferLocalHost() != "h" {
		t.Fatalf("options not applied: %v upsert=%v", c, o.upsert)
	}
}

func TestNewNeedsMaster(t *testing.T) {
	if _, err := New(context.Background(), Config{}); err == nil {
		t.Fatal("New without Master must fail")
	}
	c, err := New(context.Background(), Config{Master: "127.0.0.1:1"})
	if err != nil {
		t.Fatal(err)
	}
	if c.TenantName() != "default" || c.Tenant("x").TenantName() != "x" {
		t.Fatal("tenant defaults")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := c.Get(ctx, "k"); err == nil {
		t.Fatal("Get against a closed port must fail")
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal("Close must be idempotent")
	}
}

func TestAbandoned(t *testing.T) {
	tests := []struct {
		err  error
		want bool
	}{
		{context.Canceled, true},
		{context.DeadlineExceeded, true},
		{rpcerr.FromStatus(status.Error(codes.DeadlineExceeded, "x")), true},
		{rpcerr.FromStatus(status.Error(codes.Canceled, "x")), true},
		{rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "x"), false},
		{errors.New("plain"), false},
	}
	for _, tt := range tests {
		if got := abandoned(tt.err); got != tt.want {
			t.Errorf("abandoned(%v) = %v, want %v", tt.err, got, tt.want)
		}
	}
}
