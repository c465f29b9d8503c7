package adminsvc

import (
	"context"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"google.golang.org/grpc/codes"
)

// Migrate records the spec and answers one OK result per key (with the
// validation meta.Store.Migrate does first).
func (f *fakeMeta) Migrate(_ context.Context, sp meta.MigrateSpec) ([]meta.MigrateResult, error) {
	if err := meta.ValidateMigrate(&sp); err != nil {
		return nil, err
	}
	f.mu.Lock()
	f.migrations = append(f.migrations, sp)
	f.mu.Unlock()
	out := make([]meta.MigrateResult, len(sp.Keys))
	for i, k := range sp.Keys {
		out[i] = meta.MigrateResult{Key: k, Source: "mem-a",
			Replica: &masterv1.ReplicaDescriptor{SegmentId: "disk-a", Medium: masterv1.Medium_MEDIUM_DISK}}
	}
	return out, nil
}

// TestCopyMoveObjects: the admin forms pass the tenant (any tenant), keys,
// target and source to the metadata, answer per key, and refuse a bad
// envelope whole with INVALID_ARGUMENT / INVALID_PARAMS.
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
	if len(got) != 2 || got[0].Tenant != "other" || got[0].Move || got[0].Target.Medium != masterv1.Medium_MEDIUM_DISK ||
		!got[1].Move || got[1].FromSegment != "mem-a" || got[1].Target.SegmentID != "disk-a" {
		t.Fatalf("specs: got %+v", got)
	}
	_, err = f.client.CopyObjects(ctx, &masterv1.CopyObjectsRequest{Keys: []string{"a"}})
	wantErr(t, err, codes.InvalidArgument, "INVALID_PARAMS")
	_, err = f.client.MoveObjects(ctx, &masterv1.MoveObjectsRequest{Keys: make([]string, meta.MaxMigrateKeys+1),
		Target: &masterv1.MigrationTarget{Target: &masterv1.MigrationTarget_HostId{HostId: "host-a"}}})
	wantErr(t, err, codes.InvalidArgument, "INVALID_PARAMS")
}
