// Package changelog is the master's in-memory change log: one record per
// visibility transition (stored, removed, cleared) with a dense revision
// starting at 1 in every epoch, retained in a bounded ring. Readers resume
// from a revision; a revision that fell out of the ring is a distinct error
// (REVISION_COMPACTED) that tells the caller to resync from a snapshot.
//
// The log only stores and serves records; the metadata's mutation path is
// the only writer and appends while it holds the shard lock of the objects
// the records describe, so revision order agrees with state order.
package changelog

import (
	"context"
	"math"
	"slices"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/intern"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"go.opentelemetry.io/otel/trace"
)

// DefaultRetention is the number of records kept when Config.Retention is 0.
const DefaultRetention = 1 << 20

// Type is the kind of a record; values equal masterv1.ChangeType.
type Type uint8

// Record kinds.
const (
	Stored  = Type(masterv1.ChangeType_CHANGE_TYPE_STORED)
	Removed = Type(masterv1.ChangeType_CHANGE_TYPE_REMOVED)
	Cleared = Type(masterv1.ChangeType_CHANGE_TYPE_CLEARED)
)

// Record is one change. Revision is assigned by Append.
type Record struct {
	Revision uint64
	Type     Type
	Tenant   string
	Key      string
	Medium   masterv1.Medium
	Group    string
	TimeMs   int64
}

// Fill sets c, a zero Change, to r's wire form. The Watch adapter fills a
// response's changes in one slice instead of allocating each.
func (r Record) Fill(c *masterv1.Change) {
	c.Revision = r.Revision
	c.Type = masterv1.ChangeType(r.Type)
	c.Tenant = r.Tenant
	c.Key = r.Key
	c.Medium = r.Medium
	c.GroupId = r.Group
	c.TimestampUnixMs = r.TimeMs
}

// entry is a record as the ring stores it, 32 bytes: the key shares the
// object's bytes, tenants and groups are interned, and the time is an
// offset from its chunk's base (see chunk). With the default retention
// the ring holds as many records as a million-object cache has objects,
// so every byte here is a byte per object.
type entry struct {
	key    string
	group  uint32 // index into Log.groups; 0 is no group
	dtMs   int32  // timeMs - chunk.baseMs, or farTime
	tenant uint32
	typ    Type
	medium uint8
}

// farTime marks an entry whose time is too far from its chunk's base for
// an int32 of milliseconds (about 24.8 days: a chunk that filled slowly on
// an idle cluster, or a clock that jumped). Its time is in Log.far.
const farTime = math.MinInt32

// chunk is chunkSize consecutive ring slots. Slots are written in order,
// one lap of the ring after another, so a chunk holds entries of at most
// two laps: those of lap (the latest to reach its first slot) are offsets
// from baseMs, the first of them, and the rest, of the lap before, from
// prevBaseMs.
type chunk struct {
	lap              uint64
	baseMs, prevBase int64
	e                []entry
}

// Log is the change log. Safe for concurrent use.
type Log struct {
	epoch     atomic.Uint64
	retention uint64

	// mu guards every field below. It is a leaf lock: callers may hold a
	// metadata shard lock (or all of them) while appending.
	mu sync.Mutex
	// ring holds rev r at position (r-1)%retention, in chunks of chunkSize
	// entries allocated on first use (no regrowth copies).
	ring    []*chunk
	head    uint64 // last assigned revision (0 = none)
	tenants []string
	tenIdx  map[string]uint32
	// groups interns the records' group ids, counted per retained record.
	// Groups are the clients' strings, so unlike tenants they are
	// released, and the table never holds more than the ring.
	groups intern.Table
	// far holds the times of the retained farTime entries by revision.
	far map[uint64]int64
	// notify is closed and replaced on an append when waiting is set.
	notify  chan struct{}
	waiting bool
	// spans are the sampled spans of the latest traced appends, oldest
	// first, at most maxSpans (a ring; spanHead is the oldest): what Links
	// answers. Empty with tracing off.
	spans    []spanMark
	spanHead int
	// traced is set at the first traced append, so a log that never saw
	// one answers Links without taking mu.
	traced atomic.Bool
}

// spanMark is one traced append: its revisions and its span.
type spanMark struct {
	first, last uint64
	sc          trace.SpanContext
}

// maxSpans bounds the traced appends the log remembers: a watcher more
// than this many traced appends behind loses their links, not records.
const maxSpans = 1024

// New returns an empty log for epoch, retaining retention records (0 means
// DefaultRetention). It does no I/O.
func New(retention int, epoch uint64) *Log {
	if retention <= 0 {
		retention = DefaultRetention
	}
	l := &Log{
		retention: uint64(retention),
		notify:    make(chan struct{}),
	}
	l.resetTablesLocked()
	l.epoch.Store(epoch)
	return l
}

// Epoch is the epoch the revisions belong to.
func (l *Log) Epoch() uint64 { return l.epoch.Load() }

// Reset empties the log and starts epoch's revisions at 1: a warm
// standby's store, elected, keeps its objects but not the records it made
// while following (nobody watched them). Waiters are woken (they read an
// empty log of another epoch).
func (l *Log) Reset(epoch uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.epoch.Store(epoch)
	l.ring, l.head = nil, 0
	l.resetTablesLocked()
	l.spans, l.spanHead = nil, 0
	l.traced.Store(false)
	close(l.notify)
	l.notify, l.waiting = make(chan struct{}), false
}

// Append assigns the next revisions to recs (in order, writing them back
// into recs) and stores them. It returns the last revision assigned.
func (l *Log) Append(recs []Record) uint64 {
	return l.AppendTraced(recs, trace.SpanContext{})
}

// AppendTraced is Append for records made under span sc: when sc is
// sampled, Links names it for their revisions (the gateway's publish span
// links to it).
func (l *Log) AppendTraced(recs []Record, sc trace.SpanContext) uint64 {
	if len(recs) == 0 {
		return l.Head()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if sc.IsSampled() {
		l.traced.Store(true)
		l.markLocked(spanMark{first: l.head + 1, last: l.head + uint64(len(recs)), sc: sc})
	}
	for i := range recs {
		l.head++
		recs[i].Revision = l.head
		l.storeLocked(l.head, &recs[i])
	}
	if l.waiting {
		close(l.notify)
		l.notify = make(chan struct{})
		l.waiting = false
	}
	return l.head
}

const chunkSize = 4096

// markLocked remembers m, merging it into the newest mark of the same span
// (a batch appends once per shard).
func (l *Log) markLocked(m spanMark) {
	if n := len(l.spans); n > 0 {
		newest := &l.spans[(l.spanHead+n-1)%n]
		if newest.sc.Equal(m.sc) && newest.last+1 == m.first {
			newest.last = m.last
			return
		}
	}
	if len(l.spans) < maxSpans {
		l.spans = append(l.spans, m)
		return
	}
	l.spans[l.spanHead] = m
	l.spanHead = (l.spanHead + 1) % maxSpans
}

// Links appends to dst the distinct sampled spans that recorded revisions
// in (from, to], oldest first, at most max of them (the first max).
func (l *Log) Links(from, to uint64, max int, dst []trace.SpanContext) []trace.SpanContext {
	if !l.traced.Load() {
		return dst
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	n := len(l.spans)
	if n == 0 || from >= to {
		return dst
	}
	// Marks are in revision order: find the first that ends after from.
	i := sort.Search(n, func(i int) bool { return l.spans[(l.spanHead+i)%n].last > from })
	for ; i < n && len(dst) < max; i++ {
		m := &l.spans[(l.spanHead+i)%n]
		if m.first > to {
			break
		}
		if !slices.ContainsFunc(dst, m.sc.Equal) {
			dst = append(dst, m.sc)
		}
	}
	return dst
}

func (l *Log) resetTablesLocked() {
	l.tenants, l.tenIdx = nil, make(map[string]uint32)
	l.groups = intern.Table{}
	l.far = make(map[uint64]int64)
}

// storeLocked writes rec as revision r into its ring slot, releasing what
// the record it overwrites (r-retention) held.
func (l *Log) storeLocked(r uint64, rec *Record) {
	pos := (r - 1) % l.retention
	c := pos / chunkSize
	for uint64(len(l.ring)) <= c {
		l.ring = append(l.ring, nil)
	}
	ch := l.ring[c]
	if ch == nil {
		ch = &chunk{e: make([]entry, min(chunkSize, l.retention-c*chunkSize))}
		l.ring[c] = ch
	}
	i := pos % chunkSize
	e := &ch.e[i]
	if r > l.retention {
		l.groups.Release(e.group)
		if e.dtMs == farTime {
			delete(l.far, r-l.retention)
		}
	}
	if i == 0 {
		ch.lap, ch.prevBase, ch.baseMs = (r-1)/l.retention, ch.baseMs, rec.TimeMs
	}
	dt := rec.TimeMs - ch.baseMs
	if dt <= farTime || dt > math.MaxInt32 {
		l.far[r] = rec.TimeMs
		dt = farTime
	}
	*e = entry{
		key:    rec.Key,
		group:  l.groups.Intern(rec.Group),
		dtMs:   int32(dt),
		tenant: l.internLocked(rec.Tenant),
		typ:    rec.Type,
		medium: uint8(rec.Medium),
	}
}

// recordLocked returns retained revision r.
func (l *Log) recordLocked(r uint64) Record {
	pos := (r - 1) % l.retention
	ch := l.ring[pos/chunkSize]
	e := &ch.e[pos%chunkSize]
	base := ch.baseMs
	if (r-1)/l.retention != ch.lap {
		base = ch.prevBase
	}
	t := base + int64(e.dtMs)
	if e.dtMs == farTime {
		t = l.far[r]
	}
	return Record{
		Revision: r,
		Type:     e.typ,
		Tenant:   l.tenants[e.tenant],
		Key:      e.key,
		Medium:   masterv1.Medium(e.medium),
		Group:    l.groups.Name(e.group),
		TimeMs:   t,
	}
}

func (l *Log) internLocked(t string) uint32 {
	if i, ok := l.tenIdx[t]; ok {
		return i
	}
	i := uint32(len(l.tenants))
	l.tenants = append(l.tenants, t)
	l.tenIdx[t] = i
	return i
}

// Head is the last revision recorded (0 when none).
func (l *Log) Head() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.head
}

// Compact is the oldest revision still retained (head+1 when the log is
// empty).
func (l *Log) Compact() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.compactLocked()
}

func (l *Log) compactLocked() uint64 {
	if l.head < l.retention {
		return 1
	}
	return l.head - l.retention + 1
}

// CompactedError is the error for a read from before the retained window.
func CompactedError(from, compact uint64) error {
	e := rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_REVISION_COMPACTED,
		"revision %d is compacted; oldest retained is %d: resync with Snapshot", from, compact)
	e.Metadata = map[string]string{"compact_revision": strconv.FormatUint(compact, 10)}
	return e
}

// Read appends to dst up to max records with revision > from, in order, and
// returns them with the head and compact revisions at the time of the read.
// It fails with REVISION_COMPACTED when record from+1 is no longer retained,
// and with INVALID_PARAMS when from is beyond the head.
func (l *Log) Read(from uint64, max int, dst []Record) (recs []Record, head, compact uint64, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	compact = l.compactLocked()
	if from+1 < compact {
		return dst, l.head, compact, CompactedError(from, compact)
	}
	if from > l.head {
		return dst, l.head, compact, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
			"revision %d is beyond the head %d of epoch %d", from, l.head, l.epoch.Load())
	}
	for r := from + 1; r <= l.head && (max <= 0 || len(dst) < max); r++ {
		dst = append(dst, l.recordLocked(r))
	}
	return dst, l.head, compact, nil
}

// Wait blocks until the head passes after or ctx ends (returning its error).
func (l *Log) Wait(ctx context.Context, after uint64) error {
	l.mu.Lock()
	if l.head > after {
		l.mu.Unlock()
		return nil
	}
	l.waiting = true
	ch := l.notify
	l.mu.Unlock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
