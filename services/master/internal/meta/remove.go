package meta

import (
	"context"
	"regexp"
	"regexp/syntax"
	"strconv"
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

// removeEvery removes every object of the tenant that may be removed,
// skipping (and counting) the others, one shard lock at a time.
func (s *Store) removeEvery(ctx context.Context, t uint32, force bool) (removed, skipped uint64) {
	rel := &releases{}
	name := s.tenants.get(t).name
	for i := range s.shards {
		shd := &s.shards[i]
		shd.mu.Lock()
		m := s.begin(shd, rel)
		for _, o := range shd.tenants[t] {
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
	removed, skipped = s.removeEvery(ctx, t, force)
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

// RemoveByPrefix removes the tenant's objects whose key starts with
// prefix, one bounded page at a time (see scanRemove): pageToken is "" or
// the previous call's next token, and next is "" once the scan is complete.
func (s *Store) RemoveByPrefix(ctx context.Context, tenant, prefix string, force bool, pageToken string) (removed, skipped uint64, next string, err error) {
	tenant = NormalizeTenant(tenant)
	if len(tenant) > MaxTenantLen {
		return 0, 0, "", errInvalid("tenant must be at most %d bytes, got %d", MaxTenantLen, len(tenant))
	}
	if prefix == "" || len(prefix) > MaxKeyLen {
		return 0, 0, "", errInvalid("prefix must be 1..%d bytes, got %d", MaxKeyLen, len(prefix))
	}
	start, err := s.decodeScanToken(pageToken)
	if err != nil {
		return 0, 0, "", err
	}
	t, ok := s.tenants.lookup(tenant)
	if !ok {
		return 0, 0, "", nil
	}
	return s.scanRemove(ctx, t, force, start, func(k string) bool { return strings.HasPrefix(k, prefix) }, nil)
}

// CompileKeyRegex compiles a RemoveByRegex pattern within MaxRegexLen and
// MaxRegexInsts, so no pattern costs more than that per byte of key.
func CompileKeyRegex(re string) (*regexp.Regexp, error) {
	if re == "" || len(re) > MaxRegexLen {
		return nil, errInvalid("regex must be 1..%d bytes, got %d", MaxRegexLen, len(re))
	}
	parsed, err := syntax.Parse(re, syntax.Perl)
	if err != nil {
		return nil, errInvalid("regex: %v", err)
	}
	prog, err := syntax.Compile(parsed.Simplify())
	if err != nil {
		return nil, errInvalid("regex: %v", err)
	}
	if len(prog.Inst) > MaxRegexInsts {
		return nil, errInvalid("regex compiles to %d instructions, max %d", len(prog.Inst), MaxRegexInsts)
	}
	rx, err := regexp.Compile(re)
	if err != nil {
		return nil, errInvalid("regex: %v", err)
	}
	return rx, nil
}

// RemoveByRegex removes the tenant's objects whose key matches re (RE2,
// limited by CompileKeyRegex), paged like RemoveByPrefix. Keys are matched
// with no shard lock held.
func (s *Store) RemoveByRegex(ctx context.Context, tenant, re string, force bool, pageToken string) (removed, skipped uint64, next string, err error) {
	tenant = NormalizeTenant(tenant)
	if len(tenant) > MaxTenantLen {
		return 0, 0, "", errInvalid("tenant must be at most %d bytes, got %d", MaxTenantLen, len(tenant))
	}
	rx, err := CompileKeyRegex(re)
	if err != nil {
		return 0, 0, "", err
	}
	start, err := s.decodeScanToken(pageToken)
	if err != nil {
		return 0, 0, "", err
	}
	t, ok := s.tenants.lookup(tenant)
	if !ok {
		return 0, 0, "", nil
	}
	return s.scanRemove(ctx, t, force, start, nil, rx.MatchString)
}

// scanRemove removes the tenant's objects whose key passes pre and match,
// scanning shards from start until it has examined ScanBudget keys (whole
// shards); next is the page token to continue from, "" when the last shard
// was scanned. Per shard, the keys that pass pre (a cheap test, run under
// the lock) are copied out under the lock; match (the costly one) runs with
// no lock held; then the matches are removed under the lock, each looked
// up again and re-checked, so a key rewritten meanwhile is judged by its
// current state.
func (s *Store) scanRemove(ctx context.Context, t uint32, force bool, start int, pre, match func(string) bool) (removed, skipped uint64, next string, err error) {
	rel := &releases{}
	defer func() {
		cctx, cancel := cleanupCtx(ctx)
		defer cancel()
		s.sendReleases(cctx, rel)
	}()
	name := s.tenants.get(t).name
	var keys []string
	examined := 0
	for i := start; i < len(s.shards); i++ {
		if examined >= ScanBudget {
			return removed, skipped, encodeScanToken(i), nil
		}
		if err := ctx.Err(); err != nil {
			return removed, skipped, "", err
		}
		shd := &s.shards[i]
		keys = keys[:0]
		shd.mu.Lock()
		objs := shd.tenants[t]
		examined += len(objs)
		for key := range objs {
			if pre == nil || pre(key) {
				keys = append(keys, key)
			}
		}
		shd.mu.Unlock()
		if match != nil {
			n := 0
			for _, key := range keys {
				if match(key) {
					keys[n] = key
					n++
				}
			}
			keys = keys[:n]
		}
		if len(keys) == 0 {
			continue
		}
		shd.mu.Lock()
		m := s.begin(shd, rel)
		for _, key := range keys {
			o := shd.getLocked(t, key)
			if o == nil {
				continue // removed meanwhile
			}
			if s.removableLocked(o, force, m.nowMs, name) != nil {
				skipped++
				continue
			}
			m.removeAll(o, true)
			removed++
		}
		m.commit()
		shd.mu.Unlock()
		clear(keys)
	}
	return removed, skipped, "", nil
}

// encodeScanToken and decodeScanToken turn the shard a scan continues from
// into a page token and back.
func encodeScanToken(shard int) string { return "s" + strconv.Itoa(shard) }

func (s *Store) decodeScanToken(tok string) (int, error) {
	if tok == "" {
		return 0, nil
	}
	if len(tok) > 12 || tok[0] != 's' {
		return 0, errInvalid("malformed page_token")
	}
	i, err := strconv.Atoi(tok[1:])
	if err != nil || i <= 0 || i >= len(s.shards) || encodeScanToken(i) != tok {
		return 0, errInvalid("malformed page_token")
	}
	return i, nil
}
