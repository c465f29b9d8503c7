package meta

import (
	"context"
	"regexp"
	"strings"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/pkg/rpcerr"
	"github.com/crescent-kv/crescent/services/master/internal/changelog"
	"google.golang.org/grpc/codes"
)

// RemoveSpec is one Remove.
type RemoveSpec struct {
	Tenant, Key string
	Force       bool
}

// removableLocked says whether o may be removed now: never while a write is
// in progress; not while leased or hard-pinned unless force.
func (s *Store) removableLocked(o *object, force bool, nowMs int64, tenant string) error {
	if o.put != nil {
		return rpcerr.New(codes.FailedPrecondition, masterv1.ErrorReason_ERROR_REASON_OBJECT_BUSY,
			"object %q/%q has a write in progress", tenant, o.key)
	}
	if force {
		return nil
	}
	if o.leased(nowMs, s.cfg.LeaseTTL) {
		return rpcerr.New(codes.FailedPrecondition, masterv1.ErrorReason_ERROR_REASON_OBJECT_HAS_LEASE,
			"object %q/%q holds a read lease", tenant, o.key)
	}
	if o.flags&flagHardPin != 0 {
		return rpcerr.New(codes.FailedPrecondition, masterv1.ErrorReason_ERROR_REASON_OBJECT_BUSY,
			"object %q/%q is hard-pinned; remove with force", tenant, o.key)
	}
	return nil
}

// Remove deletes one object; see BatchRemove.
func (s *Store) Remove(ctx context.Context, sp RemoveSpec) error {
	return s.BatchRemove(ctx, []RemoveSpec{sp})[0]
}

// BatchRemove deletes many objects, one lock per shard, releases batched
// per agent.
func (s *Store) BatchRemove(ctx context.Context, specs []RemoveSpec) []error {
	res := make([]error, len(specs))
	items := s.locateAll(len(specs),
		func(i int) (*string, string) { return &specs[i].Tenant, specs[i].Key },
		func(i int, err error) { res[i] = err })
	rel := &releases{}
	forShards(items, located.shardOf, func(sh int, group []located) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, rel)
		for _, it := range group {
			sp := &specs[it.i]
			o := shd.getLocked(it.tenant, sp.Key)
			if o == nil {
				res[it.i] = errNotFound(sp.Tenant, sp.Key)
				continue
			}
			if err := s.removableLocked(o, sp.Force, m.nowMs, sp.Tenant); err != nil {
				res[it.i] = err
				continue
			}
			m.removeAll(o, true)
		}
		m.commit()
		shd.mu.Unlock()
	})
	cctx, cancel := cleanupCtx(ctx)
	defer cancel()
	s.sendReleases(cctx, rel)
	return res
}

// removeMatching removes the tenant's objects for which match is true,
// skipping (and counting) those that may not be removed. It returns the
// counts and whether the tenant held anything when the scan started.
func (s *Store) removeMatching(ctx context.Context, t uint32, force bool, match func(key string) bool) (removed, skipped uint64) {
	rel := &releases{}
	name := s.tenants.get(t).name
	for i := range s.shards {
		shd := &s.shards[i]
		shd.mu.Lock()
		m := s.begin(shd, rel)
		for key, o := range shd.tenants[t] {
			if !match(key) {
				continue
			}
			if s.removableLocked(o, force, m.nowMs, name) != nil {
				skipped++
				continue
			}
			m.removeAll(o, true) // deleting during range is safe in Go
			removed++
		}
		m.commit()
		shd.mu.Unlock()
	}
	cctx, cancel := cleanupCtx(ctx)
	defer cancel()
	s.sendReleases(cctx, rel)
	return removed, skipped
}

// RemoveAll removes every object of tenant that may be removed. When it
// removed something, skipped nothing and the tenant is then empty (checked
// with every shard locked, so no write slips in between), it records
// `cleared`.
func (s *Store) RemoveAll(ctx context.Context, tenant string, force bool) (removed, skipped uint64, err error) {
	tenant = NormalizeTenant(tenant)
	if len(tenant) > MaxTenantLen {
		return 0, 0, errInvalid("tenant must be at most %d bytes", MaxTenantLen)
	}
	t, ok := s.tenants.lookup(tenant)
	if !ok {
		return 0, 0, nil
	}
	removed, skipped = s.removeMatching(ctx, t, force, func(string) bool { return true })
	if removed == 0 || skipped > 0 {
		return removed, skipped, nil
	}
	s.lockAll()
	empty := true
	for i := range s.shards {
		if len(s.shards[i].tenants[t]) > 0 {
			empty = false
			break
		}
	}
	if empty {
		recs := []changelog.Record{{Type: changelog.Cleared, Tenant: tenant, TimeMs: s.nowMs()}}
		s.log.Append(recs)
		s.changes.Inc()
	}
	for i := range s.shards {
		s.shards[i].mu.Unlock()
	}
	return removed, skipped, nil
}

// RemoveByPrefix removes the tenant's objects whose key starts with prefix.
func (s *Store) RemoveByPrefix(ctx context.Context, tenant, prefix string, force bool) (removed, skipped uint64, err error) {
	tenant = NormalizeTenant(tenant)
	if len(tenant) > MaxTenantLen || len(prefix) > MaxKeyLen {
		return 0, 0, errInvalid("tenant or prefix too long")
	}
	t, ok := s.tenants.lookup(tenant)
	if !ok {
		return 0, 0, nil
	}
	removed, skipped = s.removeMatching(ctx, t, force, func(k string) bool { return strings.HasPrefix(k, prefix) })
	return removed, skipped, nil
}

// MaxRegexLen bounds RemoveByRegex patterns.
const MaxRegexLen = 4096

// RemoveByRegex removes the tenant's objects whose key matches re (RE2).
func (s *Store) RemoveByRegex(ctx context.Context, tenant, re string, force bool) (removed, skipped uint64, err error) {
	tenant = NormalizeTenant(tenant)
	if len(tenant) > MaxTenantLen {
		return 0, 0, errInvalid("tenant must be at most %d bytes", MaxTenantLen)
	}
	if re == "" || len(re) > MaxRegexLen {
		return 0, 0, errInvalid("regex must be 1..%d bytes", MaxRegexLen)
	}
	rx, cerr := regexp.Compile(re)
	if cerr != nil {
		return 0, 0, errInvalid("regex: %v", cerr)
	}
	t, ok := s.tenants.lookup(tenant)
	if !ok {
		return 0, 0, nil
	}
	removed, skipped = s.removeMatching(ctx, t, force, rx.MatchString)
	return removed, skipped, nil
}
