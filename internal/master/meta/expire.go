package meta

import (
	"context"
	"errors"
	"sync"

	"github.com/cespare/xxhash/v2"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// Abandoned puts. A PutStart that never sees its PutEnd (or PutRevoke)
// would keep its object, its quota charge and its placed bytes forever: the
// agent frees the reservation after its reserved grace, the metadata would
// not. So each shard lists its puts in progress, oldest start first, and
// the sweep (Run, every PutSweepInterval) expires the open ones older than
// the put timeout (PutPreemptAfter) through the mutation path: each
// PROCESSING replica FAILED then REMOVED (released at its agent), the
// object erased (its quota refunded). Nothing is published: the object was
// never readable (an upsert's old version was removed, and published, at
// its PutStart, as today). The sweep looks at list heads only, so a tick
// costs a lock per shard plus the puts it expires.

// putList is a shard's puts in progress, linked through putState.prev and
// next, oldest start first: a put is appended when it starts (the store's
// clock seldom steps back; when it does, a put sits behind a later one and
// expires late by the step) and unlinked when it ends, is revoked,
// preempted or expired. Guarded by the shard's lock.
type putList struct{ head, tail *putState }

func (l *putList) linked(ps *putState) bool { return ps.prev != nil || l.head == ps }

func (l *putList) push(ps *putState) {
	ps.prev, ps.next = l.tail, nil
	if l.tail == nil {
		l.head = ps
	} else {
		l.tail.next = ps
	}
	l.tail = ps
}

func (l *putList) remove(ps *putState) {
	if !l.linked(ps) {
		return
	}
	if ps.prev == nil {
		l.head = ps.next
	} else {
		ps.prev.next = ps.next
	}
	if ps.next == nil {
		l.tail = ps.prev
	} else {
		ps.next.prev = ps.prev
	}
	ps.prev, ps.next = nil, nil
}

// startPutLocked makes ps the put in progress of o (ending any earlier
// one) and lists it.
func (sh *shard) startPutLocked(o *object, ps *putState) {
	sh.endPutLocked(o)
	ps.obj = o
	o.put = ps
	sh.puts.push(ps)
}

// endPutLocked clears o's put in progress, if any, and unlists it. Code
// that clears object.put directly leaves a stale entry, which the sweep
// drops when it reaches it (ps.obj.put != ps).
func (sh *shard) endPutLocked(o *object) {
	if ps := o.put; ps != nil {
		sh.puts.remove(ps)
		o.put = nil
	}
}

// expireBudget bounds the puts one sweep expires per shard, and so how
// long it holds a shard lock; a larger backlog goes on the next ticks.
const expireBudget = 1024

// expirePuts expires every open put whose start is at least the put
// timeout ago on the store's clock (up to expireBudget per shard), and
// releases their allocations at the agents. Puts still being placed or
// sealed are left to the RPC that is at the agents for them (bounded by
// the agent timeout); it settles them and they leave the list then. It
// returns the number expired.
func (s *Store) expirePuts(ctx context.Context) int {
	timeout := s.cfg.PutPreemptAfter.Milliseconds()
	rel := &releases{}
	n := 0
	for i := range s.shards {
		shd := &s.shards[i]
		shd.mu.Lock()
		if h := shd.puts.head; h == nil || s.nowMs()-h.startMs < timeout {
			shd.mu.Unlock()
			continue
		}
		m := s.begin(shd, rel)
		budget := expireBudget
		for ps := shd.puts.head; ps != nil && m.nowMs-ps.startMs >= timeout && budget > 0; budget-- {
			next := ps.next
			switch o := ps.obj; {
			case o == nil || o.put != ps:
				shd.puts.remove(ps) // cleared without endPutLocked
			case ps.phase == phaseOpen:
				s.expireLocked(m, o)
				n++
			}
			ps = next // (a busy put costs budget too: the walk is bounded)
		}
		m.commit()
		shd.mu.Unlock()
	}
	if n > 0 {
		s.expired.Add(float64(n))
		s.lg.Info("expired abandoned puts", "puts", n, "put_timeout", s.cfg.PutPreemptAfter)
		s.sendReleasesNow(ctx, rel)
	}
	return n
}

// expireLocked expires o's open put: REPLICA_FAILED and REPLICA_REMOVE for
// each of its PROCESSING replicas (released at the agents), then the
// object is erased and its quota refunded.
func (s *Store) expireLocked(m *mut, o *object) {
	for i := len(o.replicas) - 1; i >= 0; i-- {
		if o.replicas[i].status == stComplete {
			continue // never for an open put; kept as it would be readable
		}
		m.fail(o, i)
		m.remove(o, i, true)
	}
	m.sh.endPutLocked(o)
	s.expiredPuts.add(expiredHash(s.tenants.get(o.tenant).name, o.key))
	m.dropIfEmpty(o)
}

// expiredRemembered is how many expired puts PutEnd and PutRevoke can tell
// from keys that never had a put (PUT_EXPIRED rather than
// OBJECT_NOT_FOUND): 16384 hashes, about 0.5 MiB.
const expiredRemembered = 1 << 14

// expiredSet remembers the last expiredRemembered expired puts by a hash
// of (tenant, key). A collision only turns an OBJECT_NOT_FOUND into a
// PUT_EXPIRED.
type expiredSet struct {
	// mu guards the fields below; leaf lock (taken under a shard lock).
	mu   sync.Mutex
	ring []uint64 // allocated on the first expiry
	next int
	n    map[uint64]uint32 // hash → occurrences in ring
}

func expiredHash(tenant, key string) uint64 {
	var d xxhash.Digest
	d.Reset()
	_, _ = d.WriteString(tenant)
	_, _ = d.Write([]byte{0})
	_, _ = d.WriteString(key)
	return d.Sum64()
}

func (e *expiredSet) add(h uint64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.ring == nil {
		e.ring = make([]uint64, 0, expiredRemembered)
		e.n = make(map[uint64]uint32)
	}
	if len(e.ring) < expiredRemembered {
		e.ring = append(e.ring, h)
	} else {
		old := e.ring[e.next]
		if e.n[old]--; e.n[old] == 0 {
			delete(e.n, old)
		}
		e.ring[e.next] = h
		e.next = (e.next + 1) % expiredRemembered
	}
	e.n[h]++
}

func (e *expiredSet) has(h uint64) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.n[h] > 0
}

// errObjectNotFound matches (errors.Is) any OBJECT_NOT_FOUND error.
var errObjectNotFound = &rpcerr.Error{Reason: masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND}

// notFoundOrExpired turns an OBJECT_NOT_FOUND answer to a PutEnd or
// PutRevoke of (tenant, key) into PUT_EXPIRED when the sweep expired a put
// of that key lately; other errors pass unchanged.
func (s *Store) notFoundOrExpired(err error, tenant, key string) error {
	if errors.Is(err, errObjectNotFound) && s.expiredPuts.has(expiredHash(tenant, key)) {
		return errPutExpired(tenant, key)
	}
	return err
}
