package session

import (
	"context"
	"errors"
	"io"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/protobuf/proto"
)

// MaxRegisterChunk is the most allocations one RegisterChunk may carry.
// Agents also keep a chunk near 1 MiB (link.maxChunkBytes); gRPC's message
// limit bounds the bytes the master decodes before it looks at a chunk.
const MaxRegisterChunk = 16384

// maxRegisterAllocations bounds a chunked Register's allocation_count: far
// past any agent (a 1 TiB segment of 4 KiB blocks is 2^28), and nothing is
// allocated from the count, which only has to match the chunks.
const maxRegisterAllocations = 1 << 34

// tableCursor checks a chunked allocation table as it streams in, without
// remembering it: chunks come grouped by segment in the Register's segment
// order, allocation ids strictly increasing within a segment, so a
// repeated or misplaced allocation breaks the order.
type tableCursor struct {
	order map[string]int // segment id → position in Register.segments
	seg   int            // position of the current segment; -1 before the first
	last  uint64         // last allocation id of the current segment
	first bool           // no allocation of the current segment yet
	got   uint64
	want  uint64
}

func newTableCursor(r *masterv1.Register) *tableCursor {
	c := &tableCursor{order: make(map[string]int, len(r.GetSegments())), seg: -1, want: r.GetAllocationCount()}
	for i, s := range r.GetSegments() {
		c.order[s.GetSegmentId()] = i
	}
	return c
}

// check validates one chunk against the sequence so far and fills in its
// allocations' segment id (they leave it to the chunk).
func (c *tableCursor) check(ch *masterv1.RegisterChunk) error {
	allocs := ch.GetAllocations()
	if len(allocs) > MaxRegisterChunk {
		return invalid("register chunk: %d allocations, max %d per chunk", len(allocs), MaxRegisterChunk)
	}
	if uint64(len(allocs)) > c.want-c.got {
		return invalid("register chunk: %d more allocations than the %d the Register announced", c.got+uint64(len(allocs))-c.want, c.want)
	}
	if len(allocs) > 0 {
		seg := ch.GetSegmentId()
		pos, listed := c.order[seg]
		switch {
		case !listed:
			return invalid("register chunk: segment %q the agent did not list", seg)
		case pos < c.seg:
			return invalid("register chunk: segment %q out of order (want segments in the Register's order)", seg)
		case pos > c.seg:
			c.seg, c.last, c.first = pos, 0, true
		}
		for _, a := range allocs {
			switch {
			case a.GetSegmentId() != "" && a.GetSegmentId() != seg:
				return invalid("register chunk: allocation %d names segment %q in a chunk of segment %q", a.GetAllocationId(), a.GetSegmentId(), seg)
			case !c.first && a.GetAllocationId() <= c.last:
				return invalid("register chunk: allocation %d of segment %q out of order (want ids increasing within a segment)", a.GetAllocationId(), seg)
			case a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_RESERVED && a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_SEALED:
				return invalid("register chunk: allocation %d of segment %q has state %v", a.GetAllocationId(), seg, a.GetState())
			case a.GetKey() == "" && !blankReserved(a):
				return invalid("register chunk: allocation %d of segment %q has no key", a.GetAllocationId(), seg)
			case a.GetBlank() && !blankReserved(a):
				return invalid("register chunk: allocation %d of segment %q is blank with an object or not RESERVED", a.GetAllocationId(), seg)
			}
			a.SegmentId = seg
			c.last, c.first = a.GetAllocationId(), false
		}
	}
	c.got += uint64(len(allocs))
	if ch.GetLast() && c.got != c.want {
		return invalid("register chunk: last chunk after %d allocations, the Register announced %d", c.got, c.want)
	}
	return nil
}

// errStalled is a chunked registration that stopped making progress.
func errStalled(timeout time.Duration, got, want uint64) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE,
		"registration stalled: no RegisterChunk within %v after %d of %d allocations", timeout, got, want)
}

// receiveTable reads a chunked Register's allocation table and applies each
// chunk as it arrives. Every chunk must arrive within RegisterTimeout of
// the one before (the deadline follows progress, not the table's size), and
// each one refreshes the agent's liveness. It returns the allocations the
// agent should release.
func (m *Manager) receiveTable(ctx context.Context, agentID string, gen uint64, r *masterv1.Register, rec cluster.Reconciler,
	recvc <-chan *masterv1.ConnectRequest, recvErr <-chan error) ([]*masterv1.AllocationRef, error) {
	cur := newTableCursor(r)
	var release []*masterv1.AllocationRef
	t := time.NewTimer(m.cfg.RegisterTimeout)
	defer t.Stop()
	for {
		select {
		case msg := <-recvc:
			ch := msg.GetRegisterChunk()
			if ch == nil {
				return nil, invalid("register: expected RegisterChunk until the table's last chunk, got %s", msgName(msg))
			}
			if err := cur.check(ch); err != nil {
				return nil, err
			}
			release = append(release, rec.Apply(ctx, ch.GetAllocations())...)
			m.reg.Progress(agentID, gen)
			if ch.GetLast() {
				return release, nil
			}
			t.Reset(m.cfg.RegisterTimeout)
		case err := <-recvErr:
			if errors.Is(err, io.EOF) {
				return nil, invalid("register: stream closed after %d of %d allocations", cur.got, cur.want)
			}
			return nil, err
		case <-t.C:
			return nil, errStalled(m.cfg.RegisterTimeout, cur.got, cur.want)
		case <-ctx.Done():
			return nil, causeStatus(ctx)
		}
	}
}

// reconciler returns the metadata's chunked reconcile, or one that hands
// the whole table to Reconcile at Finish for metadata without it.
func (m *Manager) reconciler(ctx context.Context, agentID string, segs []cluster.Segment, expected uint64) cluster.Reconciler {
	md := m.metadata()
	if cm, ok := md.(cluster.ChunkedMetadata); ok {
		return cm.BeginReconcile(ctx, agentID, segs, expected)
	}
	return &wholeTable{md: md, agentID: agentID, segs: segs}
}

// wholeTable collects the chunks for a metadata that reconciles at once.
type wholeTable struct {
	md      cluster.Metadata
	agentID string
	segs    []cluster.Segment
	allocs  []*masterv1.Allocation
}

func (w *wholeTable) Apply(_ context.Context, allocs []*masterv1.Allocation) []*masterv1.AllocationRef {
	for _, a := range allocs {
		w.allocs = append(w.allocs, proto.CloneOf(a)) // allocs are reused once Apply returns
	}
	return nil
}

func (w *wholeTable) Finish(ctx context.Context) []*masterv1.AllocationRef {
	return w.md.Reconcile(ctx, w.agentID, w.segs, w.allocs)
}
