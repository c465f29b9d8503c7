package adminsvc

import (
	"context"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc/codes"
)

// migration is one MigrateObjects call the fake received.
type migration struct {
	tenant string
	keys   []string
	target *masterv1.MigrationTarget
	move   bool
	from   string
}

// MigrateObjects records the call and answers one OK result per key;
// without a target it fails whole with INVALID_PARAMS, as the store does.
func (f *fakeMeta) MigrateObjects(_ context.Context, tenant string, keys []string, target *masterv1.MigrationTarget, move bool, from string) ([]*masterv1.MigrationResult, error) {
	if target == nil {
		return nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "no target")
	}
	f.mu.Lock()
	f.migrations = append(f.migrations, migration{tenant, keys, target, move, from})
	f.mu.Unlock()
	out := make([]*masterv1.MigrationResult, len(keys))
	for i, k := range keys {
		out[i] = &masterv1.MigrationResult{Key: k, Status: &masterv1.ItemStatus{}, SourceSegmentId: "mem-a",
			Replica: &masterv1.ReplicaDescriptor{SegmentId: "disk-a", Medium: masterv1.Medium_MEDIUM_DISK}}
	}
	return out, nil
}

// TestCopyMoveObjects: the admin forms pass the tenant (any tenant), keys,
// target and source to the metadata, answer per key, and map a whole
// request's failure to its status.
func TestCopyMoveObjects(t *testing.T) {
	f := newFixture(t)
	ctx := t.Context()
	cr, err := f.client.CopyObjects(ctx, &masterv1.CopyObjectsRequest{Tenant: "other", Keys: []string{"a", "b"},
		Target: &masterv1.MigrationTarget{Target: &masterv1.MigrationTarget_Medium{Medium: masterv1.Medium_MEDIUM_DISK}}})
	if err != nil {
		t.Fatal(err)
	}
	if got := len(cr.GetResults()); got != 2 || cr.GetResults()[1].GetKey() != "b" || cr.GetResults()[1].GetReplica().GetSegmentId() != "disk-a" {
		t.Fatalf("copy results: got %v, want a and b on disk-a", cr.GetResults())
	}
	_, err = f.client.MoveObjects(ctx, &masterv1.MoveObjectsRequest{Tenant: "other", Keys: []string{"a"}, FromSegmentId: "mem-a",
		Target: &masterv1.MigrationTarget{Target: &masterv1.MigrationTarget_SegmentId{SegmentId: "disk-a"}}})
	if err != nil {
		t.Fatal(err)
	}
	f.meta.mu.Lock()
	got := f.meta.migrations
	f.meta.mu.Unlock()
	if len(got) != 2 || got[0].tenant != "other" || got[0].move || got[0].target.GetMedium() != masterv1.Medium_MEDIUM_DISK ||
		!got[1].move || got[1].from != "mem-a" || got[1].target.GetSegmentId() != "disk-a" {
		t.Fatalf("calls: got %+v", got)
	}
	_, err = f.client.CopyObjects(ctx, &masterv1.CopyObjectsRequest{Keys: []string{"a"}})
	wantErr(t, err, codes.InvalidArgument, "INVALID_PARAMS")
	_, err = f.client.MoveObjects(ctx, &masterv1.MoveObjectsRequest{Keys: []string{"a"}})
	wantErr(t, err, codes.InvalidArgument, "INVALID_PARAMS")
}
