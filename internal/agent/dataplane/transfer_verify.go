package dataplane

import (
	"net"
	"sync"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
)

// A VERIFY (TRANSFER_OP_VERIFY, or DataService.Verify on the gRPC data
// path: both serve their items with verifyItem) asks the agent to read
// allocations again and check them against their sealed checksums: a client
// sends one when a replica's bytes failed its checksum and the agent may
// not have seen it (a memory segment, whose bytes leave from the mapping;
// an object read in several requests). The caller needs a read token, which
// lets it read the bytes anyway; what a VERIFY adds is work without the
// transfer, so it is bounded three ways: xfer.MaxVerifyItems items a
// request, verifyWorkers verifications at a time on the agent (more answer
// LIMIT_EXCEEDED), and an allocation found intact is not read again for
// verifyFresh (answered OK from memory; at most maxVerified remembered).
const (
	verifyWorkers = 2
	verifyFresh   = 10 * time.Minute
	maxVerified   = 1 << 16
)

type verifyKey struct {
	seg string
	id  uint64
}

// verifier holds what bounds VERIFY's work.
type verifier struct {
	sem chan struct{}
	mu  sync.Mutex
	ok  map[verifyKey]time.Time // found intact at
}

func newVerifier() *verifier {
	return &verifier{sem: make(chan struct{}, verifyWorkers), ok: make(map[verifyKey]time.Time)}
}

// fresh reports whether k was found intact within verifyFresh of now.
func (v *verifier) fresh(k verifyKey, now time.Time) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	at, ok := v.ok[k]
	return ok && now.Sub(at) < verifyFresh
}

func (v *verifier) intact(k verifyKey, now time.Time) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if len(v.ok) >= maxVerified {
		clear(v.ok)
	}
	v.ok[k] = now
}

// verify serves a VERIFY request: each item's allocation is opened with its
// read token and checked whole (segment.Handle.Verify, which drops it when
// its bytes are bad); the answer is a header alone.
func (t *transferServer) verify(c *transferConn, items []*agentv1.TransferItem) error {
	s := t.s
	resp := &agentv1.TransferResponse{Results: make([]*agentv1.TransferResult, len(items))}
	rs := make([]agentv1.TransferResult, len(items))
	for i, it := range items {
		r := &rs[i]
		resp.Results[i] = r
		var err error
		r.ObjectSize, r.Checksum, err = s.verifyItem(it.GetSegmentId(), it.GetAllocationId(), it.GetToken(), c.callerTenant())
		if err != nil {
			s.errs.WithLabelValues("transfer_verify", rpcerr.Reason(err)).Inc()
			c.itemFailed(err)
			r.Status = xfer.ItemResult(err)
		}
	}
	hdr, err := t.header(c, resp)
	if err != nil {
		return err
	}
	xfer.Gather(c.nc)
	err = t.writev(c, net.Buffers{hdr})
	if ferr := xfer.Flush(c.nc); err == nil {
		err = ferr
	}
	return err
}

// verifyItem checks one item's allocation, bounded by s.verify, and
// returns its size and sealed checksum (once the token was accepted, even
// with an error).
func (s *Server) verifyItem(segID string, allocID uint64, tok []byte, callerTenant string) (size, sum uint64, err error) {
	h, err := s.open(segID, allocID, tok, token.Read, callerTenant)
	if err != nil {
		return 0, 0, err
	}
	defer h.Close()
	size, sum = h.Size(), h.Checksum()
	k := verifyKey{segID, allocID}
	now := s.now()
	if s.verify.fresh(k, now) {
		return size, sum, nil
	}
	select {
	case s.verify.sem <- struct{}{}:
	default:
		return size, sum, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_LIMIT_EXCEEDED, "the agent is verifying %d allocations already; try later", verifyWorkers)
	}
	err = h.Verify()
	<-s.verify.sem
	if err == nil {
		s.verify.intact(k, now)
	}
	return size, sum, err
}
