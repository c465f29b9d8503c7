package objectsvc

import (
	"fmt"
	"strings"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"google.golang.org/grpc/codes"
)

func toSegment(id string) *masterv1.MigrationTarget {
	return &masterv1.MigrationTarget{Target: &masterv1.MigrationTarget_SegmentId{SegmentId: id}}
}

// TestCopyMoveLimits: a Copy or Move with no keys, too many, an empty,
// oversized or repeated key, or a target that is missing, not a medium or
// oversized is refused whole with INVALID_ARGUMENT / INVALID_PARAMS; an
// unknown target segment with NOT_FOUND / SEGMENT_NOT_FOUND.
func TestCopyMoveLimits(t *testing.T) {
	h := start(t, 2, 1, 1<<20)
	ctx := t.Context()
	h.put(t, "t", "k", 10, &masterv1.ReplicateConfig{PreferredSegments: []string{"seg-0-0"}})
	before := len(h.c.Agents.Live())
	many := make([]string, meta.MaxMigrateKeys+1)
	for i := range many {
		many[i] = fmt.Sprintf("k%d", i)
	}
	big := strings.Repeat("x", meta.MaxHostLen+1)
	cases := []struct {
		name   string
		keys   []string
		target *masterv1.MigrationTarget
		from   string
		code   codes.Code
		reason string
	}{
		{"no keys", nil, toSegment("seg-1-0"), "", codes.InvalidArgument, "INVALID_PARAMS"},
		{"too many keys", many, toSegment("seg-1-0"), "", codes.InvalidArgument, "INVALID_PARAMS"},
		{"empty key", []string{"k", ""}, toSegment("seg-1-0"), "", codes.InvalidArgument, "INVALID_PARAMS"},
		{"key too long", []string{strings.Repeat("k", meta.MaxKeyLen+1)}, toSegment("seg-1-0"), "", codes.InvalidArgument, "INVALID_PARAMS"},
		{"repeated key", []string{"k", "k"}, toSegment("seg-1-0"), "", codes.InvalidArgument, "INVALID_PARAMS"},
		{"no target", []string{"k"}, nil, "", codes.InvalidArgument, "INVALID_PARAMS"},
		{"empty target", []string{"k"}, &masterv1.MigrationTarget{}, "", codes.InvalidArgument, "INVALID_PARAMS"},
		{"unspecified medium", []string{"k"}, &masterv1.MigrationTarget{Target: &masterv1.MigrationTarget_Medium{}}, "", codes.InvalidArgument, "INVALID_PARAMS"},
		{"not a medium", []string{"k"}, &masterv1.MigrationTarget{Target: &masterv1.MigrationTarget_Medium{Medium: 42}}, "", codes.InvalidArgument, "INVALID_PARAMS"},
		{"segment id too long", []string{"k"}, toSegment(big), "", codes.InvalidArgument, "INVALID_PARAMS"},
		{"host id too long", []string{"k"}, &masterv1.MigrationTarget{Target: &masterv1.MigrationTarget_HostId{HostId: big}}, "", codes.InvalidArgument, "INVALID_PARAMS"},
		{"from segment too long", []string{"k"}, toSegment("seg-1-0"), big, codes.InvalidArgument, "INVALID_PARAMS"},
		{"unknown segment", []string{"k"}, toSegment("nope"), "", codes.NotFound, "SEGMENT_NOT_FOUND"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if c.from == "" {
				_, err := h.cli.Copy(ctx, &masterv1.ObjectServiceCopyRequest{Tenant: "t", Keys: c.keys, Target: c.target})
				wantCode(t, err, c.code, c.reason)
			}
			_, err := h.cli.Move(ctx, &masterv1.ObjectServiceMoveRequest{Tenant: "t", Keys: c.keys, Target: c.target, FromSegmentId: c.from})
			wantCode(t, err, c.code, c.reason)
			if got := len(h.c.Agents.Live()); got != before {
				t.Fatalf("allocations after refused request: got %d, want %d", got, before)
			}
		})
	}
	if got := len(h.c.Agents.Live()); got != before {
		t.Fatalf("allocations after refused requests: got %d, want %d", got, before)
	}
}

// TestCopyMoveThroughService: per-key results in request order, the new
// replica named, a missing key answered alone.
func TestCopyMoveThroughService(t *testing.T) {
	h := start(t, 3, 1, 1<<20)
	ctx := t.Context()
	h.put(t, "t", "a", 10, &masterv1.ReplicateConfig{PreferredSegments: []string{"seg-0-0"}})
	h.put(t, "t", "b", 10, &masterv1.ReplicateConfig{PreferredSegments: []string{"seg-0-0"}})
	cr, err := h.cli.Copy(ctx, &masterv1.ObjectServiceCopyRequest{Tenant: "t", Keys: []string{"a", "missing", "b"}, Target: toSegment("seg-1-0")})
	if err != nil {
		t.Fatal(err)
	}
	res := cr.GetResults()
	if len(res) != 3 {
		t.Fatalf("results: got %d, want 3", len(res))
	}
	for _, i := range []int{0, 2} {
		if res[i].GetStatus().GetCode() != 0 || res[i].GetReplica().GetSegmentId() != "seg-1-0" || res[i].GetSourceSegmentId() != "seg-0-0" ||
			res[i].GetReplica().GetStatus() != masterv1.ReplicaStatus_REPLICA_STATUS_COMPLETE {
			t.Fatalf("result %d: got %v, want OK on seg-1-0 from seg-0-0", i, res[i])
		}
	}
	if res[0].GetKey() != "a" || res[2].GetKey() != "b" {
		t.Fatalf("keys out of order: %v", res)
	}
	wantItem(t, res[1].GetStatus(), "OBJECT_NOT_FOUND")
	mr, err := h.cli.Move(ctx, &masterv1.ObjectServiceMoveRequest{Tenant: "t", Keys: []string{"a"}, FromSegmentId: "seg-1-0", Target: toSegment("seg-2-0")})
	if err != nil {
		t.Fatal(err)
	}
	if r := mr.GetResults()[0]; r.GetStatus().GetCode() != 0 || r.GetSourceSegmentId() != "seg-1-0" {
		t.Fatalf("move: got %v, want OK from seg-1-0", r)
	}
	route, err := h.cli.QueryRoute(ctx, &masterv1.QueryRouteRequest{Tenant: "t", Key: "a"})
	if err != nil {
		t.Fatal(err)
	}
	var segs []string
	for _, r := range route.GetReplicas() {
		segs = append(segs, r.GetSegmentId())
	}
	if got := strings.Join(segs, ","); got != "seg-0-0,seg-2-0" {
		t.Fatalf("a's replicas: got %s, want seg-0-0,seg-2-0", got)
	}
}
