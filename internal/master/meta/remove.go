package meta

import (
	"context"
	"encoding/base64"
	"regexp"
	"regexp/syntax"
	"slices"
	"strconv"
	"strings"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/changelog"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"go.opentelemetry.io/otel/trace"
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
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_BUSY,
			"object %q/%q has a write in progress", tenant, o.key)
	}
	if force {
		return nil
	}
	if o.leased(nowMs, s.cfg.LeaseTTL) {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_HAS_LEASE,
			"object %q/%q holds a read lease", tenant, o.key)
	}
	if o.flags&flagHardPin != 0 {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_BUSY,
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
	// A key not found may still live on a detached segment (its object
	// dropped with it): the removal is recorded all the same, so that the
	// segment's return does not bring it back (tombstone.go).
	items := s.locateAll(len(specs),
		func(i int) (*string, string) { return &specs[i].Tenant, specs[i].Key },
		func(i int, err error) {
			res[i] = err
			if rpcerr.Reason(err) == "OBJECT_NOT_FOUND" {
				s.tombs.record(specs[i].Tenant, specs[i].Key, s.nowMs(), specs[i].Force)
			}
		})
	rel := &releases{removal: true}
	sc := sampled(ctx)
	forShards(items, located.shardOf, func(sh int, group []located) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, rel).under(sc)
		for _, it := range group {
			sp := &specs[it.i]
			o := shd.getLocked(it.tenant, sp.Key)
			if o == nil {
				res[it.i] = errNotFound(sp.Tenant, sp.Key)
				s.tombs.record(sp.Tenant, sp.Key, m.nowMs, sp.Force)
				continue
			}
			if err := s.removableLocked(o, sp.Force, m.nowMs, sp.Tenant); err != nil {
				res[it.i] = err
				continue
			}
			m.removeAll(o, true)
			s.tombs.record(s.tenants.get(o.tenant).name, o.key, m.nowMs, sp.Force)
		}
		m.commit()
		shd.mu.Unlock()
	})
	s.sendReleasesNow(ctx, rel)
	if err := s.settleRemoval(ctx); err != nil {
		// Removed here, but a failover could bring them back
		// (unsettled.go); not found here, but a detached segment's
		// copy could come back.
		for i, e := range res {
			if e == nil || rpcerr.Reason(e) == "OBJECT_NOT_FOUND" {
				res[i] = err
			}
		}
	}
	return res
}

// removeEvery removes every object of the tenant that may be removed,
// skipping (and counting) the others, one shard lock at a time.
func (s *Store) removeEvery(ctx context.Context, t uint32, force bool) (removed, skipped uint64) {
	rel := &releases{removal: true}
	name := s.tenants.get(t).name
	sc := sampled(ctx)
	for i := range s.shards {
		shd := &s.shards[i]
		shd.mu.Lock()
		m := s.begin(shd, rel).under(sc)
		for _, o := range shd.tenants[t].all() {
			if s.removableLocked(o, force, m.nowMs, name) != nil {
				skipped++
				continue
			}
			m.removeAll(o, true) // deleting during range is safe in Go
			s.tombs.record(name, o.key, m.nowMs, force)
			removed++
		}
		m.commit()
		shd.mu.Unlock()
	}
	s.sendReleasesNow(ctx, rel)
	return removed, skipped
}

// RemoveAll removes every object of tenant that may be removed. When it
// removed something, skipped nothing and the tenant is then empty (checked
// with every shard locked, so no write slips in between), it records
// `cleared`.
//
// `cleared` names the tenant, not its id, so "empty" must hold for every id
// the name has: removing the tenant's last object retires it, and a put
// that starts before the check re-adds the name under a new id (its slot's
// next generation, or another slot). Objects of that id are not under t,
// yet a follower applying `cleared` would drop their `stored` records.
func (s *Store) RemoveAll(ctx context.Context, tenant string, force bool) (removed, skipped uint64, err error) {
	tenant = NormalizeTenant(tenant)
	if len(tenant) > MaxTenantLen {
		return 0, 0, errInvalid("tenant must be at most %d bytes", MaxTenantLen)
	}
	defer s.settleInto(ctx, &err)
	// Before the lookup: a tenant whose objects all live on detached
	// segments has left the table, and its keys must not come back.
	s.tombs.recordPattern(tenant, "", nil, s.nowMs(), force)
	t, ok := s.tenants.lookup(tenant)
	if !ok {
		return 0, 0, nil
	}
	removed, skipped = s.removeEvery(ctx, t, force)
	if removed == 0 || skipped > 0 {
		return removed, skipped, nil
	}
	s.lockAll()
	// With every shard locked no object can be created, and any id that
	// holds objects was added before its first object's insert (under a
	// shard lock, so before lockAll returned): lookup sees it. A name has
	// at most one live id, and a retired id holds no objects, so t and the
	// name's current id are the only ones to check.
	empty := s.tenantEmptyLocked(t)
	if cur, ok := s.tenants.lookup(tenant); ok && cur != t && empty {
		empty = s.tenantEmptyLocked(cur)
	}
	if empty {
		recs := []changelog.Record{{Type: changelog.Cleared, Tenant: tenant, TimeMs: s.nowMs()}}
		s.log.AppendTraced(recs, sampled(ctx))
		s.changes.Inc()
	}
	s.unlockAll()
	return removed, skipped, nil
}

// tenantEmptyLocked reports whether no shard holds an object under tenant
// id t (put in progress or not). Every shard must be locked (lockAll).
func (s *Store) tenantEmptyLocked(t uint32) bool {
	for i := range s.shards {
		if s.shards[i].tenants[t].len() > 0 {
			return false
		}
	}
	return true
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
	defer s.settleInto(ctx, &err)
	s.tombs.recordPattern(tenant, prefix, nil, s.nowMs(), force) // as RemoveAll's
	t, ok := s.tenants.lookup(tenant)
	if !ok {
		return 0, 0, "", nil
	}
	return s.scanRemove(ctx, t, force, start, func(k string) bool { return strings.HasPrefix(k, prefix) }, nil, 0)
}

// CompileKeyRegex compiles a RemoveByRegex pattern within MaxRegexLen and
// MaxRegexInsts, so no pattern costs more than that per byte of key.
func CompileKeyRegex(re string) (rx *regexp.Regexp, insts int, err error) {
	if re == "" || len(re) > MaxRegexLen {
		return nil, 0, errInvalid("regex must be 1..%d bytes, got %d", MaxRegexLen, len(re))
	}
	parsed, err := syntax.Parse(re, syntax.Perl)
	if err != nil {
		return nil, 0, errInvalid("regex: %v", err)
	}
	prog, err := syntax.Compile(parsed.Simplify())
	if err != nil {
		return nil, 0, errInvalid("regex: %v", err)
	}
	if len(prog.Inst) > MaxRegexInsts {
		return nil, 0, errInvalid("regex compiles to %d instructions, max %d", len(prog.Inst), MaxRegexInsts)
	}
	if rx, err = regexp.Compile(re); err != nil {
		return nil, 0, errInvalid("regex: %v", err)
	}
	return rx, len(prog.Inst), nil
}

// RemoveByRegex removes the tenant's objects whose key matches re (RE2,
// limited by CompileKeyRegex), paged like RemoveByPrefix. Keys are matched
// with no shard lock held.
func (s *Store) RemoveByRegex(ctx context.Context, tenant, re string, force bool, pageToken string) (removed, skipped uint64, next string, err error) {
	tenant = NormalizeTenant(tenant)
	if len(tenant) > MaxTenantLen {
		return 0, 0, "", errInvalid("tenant must be at most %d bytes, got %d", MaxTenantLen, len(tenant))
	}
	rx, insts, err := CompileKeyRegex(re)
	if err != nil {
		return 0, 0, "", err
	}
	start, err := s.decodeScanToken(pageToken)
	if err != nil {
		return 0, 0, "", err
	}
	defer s.settleInto(ctx, &err)
	s.tombs.recordPattern(tenant, "", rx, s.nowMs(), force) // as RemoveAll's
	t, ok := s.tenants.lookup(tenant)
	if !ok {
		return 0, 0, "", nil
	}
	return s.scanRemove(ctx, t, force, start, nil, rx, insts)
}

// matchBudget bounds the regex work of one RemoveByRegex call, in key
// bytes × program instructions (a few hundred ms of CPU at the worst): with
// MaxRegexInsts and MaxKeyLen one key costs at most 2^24 of it, so a call
// matches at least 4 of the longest keys against the largest program.
const matchBudget = 1 << 26

// scanCursor is where a paged scan resumes: a shard and, within it, the
// keys after `after` in byte order ("" = the whole shard).
type scanCursor struct {
	shard int
	after string
}

// scanRemove removes the tenant's objects whose key passes pre and rx,
// from cur on, until it has examined Config.ScanBudget keys or spent
// matchBudget on regex matching; next is the page token to continue from,
// "" once the last shard is done. Per shard, the keys past the cursor that
// pass pre (a cheap test) are copied out under the shard's lock; they are
// sorted (so a page can end inside a shard) and matched against rx with no
// lock held; then the matches are removed under the lock, each looked up
// again and re-checked, so a key rewritten meanwhile is judged by its
// current state.
func (s *Store) scanRemove(ctx context.Context, t uint32, force bool, cur scanCursor, pre func(string) bool, rx *regexp.Regexp, insts int) (removed, skipped uint64, next string, err error) {
	rel := &releases{removal: true}
	defer s.sendReleasesNow(ctx, rel)
	name := s.tenants.get(t).name
	sc := sampled(ctx)
	var keys []string
	examined, visited, work := 0, 0, 0
	for i := cur.shard; i < len(s.shards); i++ {
		if i > cur.shard && (examined >= s.cfg.ScanBudget || visited >= s.cfg.ScanBudget || work >= matchBudget) {
			return removed, skipped, encodeScanToken(scanCursor{shard: i}), nil
		}
		if err := ctx.Err(); err != nil {
			return removed, skipped, "", err
		}
		after := ""
		if i == cur.shard {
			after = cur.after
		}
		shd := &s.shards[i]
		keys = keys[:0]
		shd.mu.Lock()
		objs := shd.tenants[t]
		visited += objs.len()
		for key := range objs.all() {
			if (after == "" || key > after) && (pre == nil || pre(key)) {
				keys = append(keys, key)
			}
		}
		shd.mu.Unlock()
		slices.Sort(keys)
		matched, stop := 0, ""
		for j, key := range keys {
			examined++
			ok := true
			if rx != nil {
				work += (len(key) + 1) * insts
				ok = rx.MatchString(key)
			}
			if ok {
				keys[matched] = key
				matched++
			}
			if (examined >= s.cfg.ScanBudget || work >= matchBudget) && j < len(keys)-1 {
				stop = key
				break
			}
		}
		removed, skipped = s.removeKeys(shd, rel, sc, t, name, force, keys[:matched], removed, skipped)
		clear(keys)
		if stop != "" {
			return removed, skipped, encodeScanToken(scanCursor{shard: i, after: stop}), nil
		}
	}
	return removed, skipped, "", nil
}

// removeKeys removes the tenant's objects under keys from one shard, if
// they are still there and removable, adding to the counts.
func (s *Store) removeKeys(shd *shard, rel *releases, sc trace.SpanContext, t uint32, name string, force bool, keys []string, removed, skipped uint64) (uint64, uint64) {
	if len(keys) == 0 {
		return removed, skipped
	}
	shd.mu.Lock()
	defer shd.mu.Unlock()
	m := s.begin(shd, rel).under(sc)
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
		s.tombs.record(name, key, m.nowMs, force)
		removed++
	}
	m.commit()
	return removed, skipped
}

// encodeScanToken and decodeScanToken turn a scanCursor into a page token
// ("s<shard>" or "s<shard>.<base64url of the last key>") and back.
func encodeScanToken(c scanCursor) string {
	tok := "s" + strconv.Itoa(c.shard)
	if c.after != "" {
		tok += "." + EncodePageToken(c.after)
	}
	return tok
}

func (s *Store) decodeScanToken(tok string) (scanCursor, error) {
	if tok == "" {
		return scanCursor{}, nil
	}
	bad := errInvalid("malformed page_token")
	if len(tok) > 16+base64.RawURLEncoding.EncodedLen(MaxKeyLen) || tok[0] != 's' {
		return scanCursor{}, bad
	}
	num, key, _ := strings.Cut(tok[1:], ".")
	i, err := strconv.Atoi(num)
	if err != nil || i < 0 || i >= len(s.shards) {
		return scanCursor{}, bad
	}
	c := scanCursor{shard: i}
	if key != "" {
		if c.after, err = DecodePageToken(key); err != nil {
			return scanCursor{}, bad
		}
	}
	if encodeScanToken(c) != tok {
		return scanCursor{}, bad
	}
	return c, nil
}
