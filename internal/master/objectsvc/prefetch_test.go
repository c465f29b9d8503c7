package objectsvc

import (
	"fmt"
	"strings"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"google.golang.org/grpc/codes"
)

// TestPrefetchLimits: a Prefetch with no keys, too many, an empty,
// oversized or repeated key is refused whole with INVALID_ARGUMENT /
// INVALID_PARAMS, and queues nothing.
func TestPrefetchLimits(t *testing.T) {
	h := start(t, 2, 1, 1<<20)
	ctx := t.Context()
	h.put(t, "t", "k", 10, nil)
	many := make([]string, meta.MaxMigrateKeys+1)
	for i := range many {
		many[i] = fmt.Sprintf("k%d", i)
	}
	for _, c := range []struct {
		name string
		keys []string
	}{
		{"no keys", nil},
		{"too many keys", many},
		{"empty key", []string{"k", ""}},
		{"key too long", []string{strings.Repeat("k", meta.MaxKeyLen+1)}},
		{"repeated key", []string{"k", "k"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			for _, wait := range []bool{false, true} {
				_, err := h.cli.Prefetch(ctx, &masterv1.PrefetchRequest{Tenant: "t", Keys: c.keys, Wait: wait})
				wantCode(t, err, codes.InvalidArgument, "INVALID_PARAMS")
			}
		})
	}
	// The most keys a request may carry is accepted.
	res, err := h.cli.Prefetch(ctx, &masterv1.PrefetchRequest{Tenant: "t", Keys: many[:meta.MaxMigrateKeys]})
	if err != nil || len(res.GetResults()) != meta.MaxMigrateKeys {
		t.Fatalf("1024 keys: %d results, %v", len(res.GetResults()), err)
	}
}

// TestPrefetchThroughService: per-key results in request order: a disk
// object copied to memory with wait (its replica named), a memory object
// IN_MEMORY, a missing key OBJECT_NOT_FOUND; without wait QUEUED.
func TestPrefetchThroughService(t *testing.T) {
	h := start(t, 2, 1, 1<<20)
	h.c.Reg.Add(cluster.Segment{ID: "disk-1", AgentID: "agent-1", HostID: "host-1", DataEndpoint: "10.0.0.2:50052",
		Capacity: 1 << 20, Medium: masterv1.Medium_MEDIUM_DISK})
	ctx := t.Context()
	disk := &masterv1.ReplicateConfig{Medium: masterv1.Medium_MEDIUM_DISK}
	h.put(t, "t", "cold", 10, disk)
	h.put(t, "t", "cold2", 10, disk)
	h.put(t, "t", "hot", 10, nil)
	r, err := h.cli.Prefetch(ctx, &masterv1.PrefetchRequest{Tenant: "t", Keys: []string{"cold", "hot", "missing"}, Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	res := r.GetResults()
	if len(res) != 3 || res[0].GetKey() != "cold" || res[1].GetKey() != "hot" || res[2].GetKey() != "missing" {
		t.Fatalf("results out of order or missing: %v", res)
	}
	if res[0].GetStatus().GetCode() != 0 || res[0].GetState() != masterv1.PrefetchState_PREFETCH_STATE_COPIED ||
		res[0].GetReplica().GetMedium() != masterv1.Medium_MEDIUM_MEMORY || res[0].GetReplica().GetSegmentId() != "seg-1-0" {
		t.Fatalf("cold: got %v, want COPIED to seg-1-0 (memory on the disk's host)", res[0])
	}
	if res[1].GetStatus().GetCode() != 0 || res[1].GetState() != masterv1.PrefetchState_PREFETCH_STATE_IN_MEMORY {
		t.Fatalf("hot: got %v, want IN_MEMORY", res[1])
	}
	wantItem(t, res[2].GetStatus(), "OBJECT_NOT_FOUND")
	r, err = h.cli.Prefetch(ctx, &masterv1.PrefetchRequest{Tenant: "t", Keys: []string{"cold2", "cold"}})
	if err != nil {
		t.Fatal(err)
	}
	if s := r.GetResults()[0].GetState(); s != masterv1.PrefetchState_PREFETCH_STATE_QUEUED {
		t.Fatalf("cold2 without wait: %v, want QUEUED", s)
	}
	if s := r.GetResults()[1].GetState(); s != masterv1.PrefetchState_PREFETCH_STATE_IN_MEMORY {
		t.Fatalf("cold without wait after its copy: %v, want IN_MEMORY", s)
	}
}
