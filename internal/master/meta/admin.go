package meta

import (
	"context"
	"slices"
	"strings"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// Stats returns the objects and bytes held (including puts in progress;
// bytes once per object) and the change log head, for AdminService.
func (s *Store) Stats() (objects, bytes, revision uint64) {
	for _, t := range s.tenants.all() {
		t.mu.Lock()
		objects += t.usedObjects
		bytes += t.usedBytes
		t.mu.Unlock()
	}
	return objects, bytes, s.log.Head()
}

// SetTenantQuota sets a tenant's limits (0 = unlimited). A limit below the
// current usage rejects only growth. Setting a quota adds the tenant;
// clearing both limits of a tenant that holds nothing drops it.
func (s *Store) SetTenantQuota(ctx context.Context, tenant string, maxBytes, maxObjects uint64) (*masterv1.TenantQuota, error) {
	tenant = NormalizeTenant(tenant)
	if len(tenant) > MaxTenantLen {
		return nil, errInvalid("tenant must be at most %d bytes, got %d", MaxTenantLen, len(tenant))
	}
	i, err := s.tenants.acquire(tenant)
	if err != nil {
		return nil, err
	}
	defer s.tenants.release(i)
	t := s.tenants.get(i)
	t.mu.Lock()
	t.maxBytes, t.maxObjects = maxBytes, maxObjects
	t.mu.Unlock()
	return t.quota(), nil
}

// TenantQuota returns a tenant's limits and usage (zeros for a tenant the
// table does not hold).
func (s *Store) TenantQuota(ctx context.Context, tenant string) (*masterv1.TenantQuota, error) {
	tenant = NormalizeTenant(tenant)
	if len(tenant) > MaxTenantLen {
		return nil, errInvalid("tenant must be at most %d bytes, got %d", MaxTenantLen, len(tenant))
	}
	t := s.tenants.lookupLive(tenant)
	if t == nil {
		return &masterv1.TenantQuota{Tenant: tenant}, nil
	}
	return t.quota(), nil
}

// ListTenants returns the limits and usage of every tenant that holds
// something or has a quota, by name.
func (s *Store) ListTenants(ctx context.Context) []*masterv1.TenantQuota {
	var out []*masterv1.TenantQuota
	for _, t := range s.tenants.all() {
		out = append(out, t.quota())
	}
	slices.SortFunc(out, func(a, b *masterv1.TenantQuota) int { return strings.Compare(a.Tenant, b.Tenant) })
	return out
}

// SnapshotEntry is one readable (tenant, key, medium).
type SnapshotEntry struct {
	Tenant, Key, Group string
	Medium             masterv1.Medium
}

// Snapshot returns the readable set (for one tenant, or all when tenant is
// "") and the revision it reflects: Watch from that revision continues it
// exactly. Every shard is locked before the revision is read and each is
// unlocked as soon as it has been copied, so no change with a later
// revision is in the copy and none with an earlier one is missing.
//
// The tenant's id is looked up with every shard locked too: an id looked up
// before could be one the tenant has since retired from (its last object
// removed) and been re-added under another, whose objects the copy would
// then miss although their `stored` records are before the revision. Under
// the locks, the id lookup returns is the only one holding objects (see
// RemoveAll).
func (s *Store) Snapshot(ctx context.Context, tenant string) (uint64, []SnapshotEntry, error) {
	filter := tenant != ""
	if filter && len(tenant) > MaxTenantLen {
		return 0, nil, errInvalid("tenant must be at most %d bytes", MaxTenantLen)
	}
	s.lockAll()
	rev := s.log.Head()
	var only uint32
	if filter {
		var ok bool
		if only, ok = s.tenants.lookup(tenant); !ok {
			s.unlockAll()
			return rev, nil, nil
		}
	}
	var out []SnapshotEntry
	for sh := range s.shards {
		shd := &s.shards[sh]
		for t, objs := range shd.tenants {
			if filter && t != only {
				continue
			}
			name := s.tenants.get(t).name
			for key, o := range objs.all() {
				var media uint8
				for _, r := range o.replicas {
					if r.status == stComplete && media&(1<<r.medium) == 0 {
						media |= 1 << r.medium
						out = append(out, SnapshotEntry{Tenant: name, Key: key, Group: shd.groupOf(o), Medium: masterv1.Medium(r.medium)})
					}
				}
			}
		}
		shd.mu.Unlock()
	}
	return rev, out, nil
}
