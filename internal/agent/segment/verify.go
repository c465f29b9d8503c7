package segment

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"syscall"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// Defaults of VerifyConfig.
const (
	// DefaultVerifyBuffer is the read size of VerifySealed: large enough
	// for sequential disk throughput, small enough to be the whole memory
	// cost of a verification of any segment size.
	DefaultVerifyBuffer = 4 << 20
	// DefaultVerifyProgressEvery is how often VerifySealed reports progress.
	DefaultVerifyProgressEvery = 5 * time.Second
	// MaxCorruptDetails bounds VerifyReport.Corrupt, so a disk gone bad
	// as a whole costs a count, not a record per object.
	MaxCorruptDetails = 1000
)

// VerifyConfig tunes VerifySealed. The zero value uses the defaults.
type VerifyConfig struct {
	// BufferSize is the size of the one read buffer reused for every
	// allocation (DefaultVerifyBuffer when 0).
	BufferSize int
	// ProgressEvery is the minimum time between two Progress calls
	// (DefaultVerifyProgressEvery when 0).
	ProgressEvery time.Duration
	// Progress, when set, is called with the running totals at most once
	// per ProgressEvery while verifying, and once at the end.
	Progress func(VerifyProgress)
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// VerifyProgress is the running state of a verification.
type VerifyProgress struct {
	// VerifiedBytes of TotalBytes (the object bytes of every sealed
	// allocation) have been read and hashed.
	VerifiedBytes, TotalBytes uint64
	// Allocations verified so far, and of them Corrupt.
	Allocations, Corrupt int
	Elapsed              time.Duration
}

// CorruptAllocation is a sealed allocation whose bytes no longer hash to
// its sealed checksum (or could not be read at all). VerifySealed has
// dropped it from the table.
type CorruptAllocation struct {
	ID, Offset, Size uint64
	Tenant, Key      string
	ReplicaID        uint32
	// Want is the sealed checksum, Got what the bytes hash to (0 with Err).
	Want, Got uint64
	// Err is the I/O error that made the bytes unreadable, or nil.
	Err error
}

// VerifyReport is what VerifySealed found.
type VerifyReport struct {
	// Allocations and Bytes are what was verified (sealed allocations
	// and their object bytes).
	Allocations int
	Bytes       uint64
	// CorruptCount allocations were dropped; Corrupt describes the first
	// MaxCorruptDetails of them.
	CorruptCount int
	Corrupt      []CorruptAllocation
	Took         time.Duration
}

// VerifySealed reads every SEALED allocation's bytes, in offset order
// through one reused buffer, and checks them against the checksum they were
// sealed with (the object checksum, internal/checksum, as Seal computes it). An
// allocation that does not match, or whose bytes fail to read with EIO, is
// dropped: its release is journaled (and synced) so it stays gone after
// another restart, its extent is freed, and reads of it answer DATA_LOSS
// CHECKSUM_MISMATCH for as long as the segment is mounted (ids are never
// reused). Because it is no longer in the table, the agent's Register does
// not report it and the master removes the replica that pointed at it.
//
// It is meant to run once, right after OpenDisk and before the segment is
// served or registered; it is safe, but not useful, on a live segment (an
// allocation released meanwhile is skipped). Any other read error, a failed
// journal write, or ctx ending stops it with an error.
func (s *Segment) VerifySealed(ctx context.Context, cfg VerifyConfig) (VerifyReport, error) {
	if cfg.BufferSize <= 0 {
		cfg.BufferSize = DefaultVerifyBuffer
	}
	if cfg.ProgressEvery <= 0 {
		cfg.ProgressEvery = DefaultVerifyProgressEvery
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	start := cfg.Now()

	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return VerifyReport{}, errClosed
	}
	entries := s.sealedLocked()
	s.mu.Unlock()
	// Offset order reads the file sequentially.
	slices.SortFunc(entries, func(x, y *entry) int { return cmp.Compare(x.offset, y.offset) })
	p := VerifyProgress{}
	for _, e := range entries {
		p.TotalBytes += e.size
	}

	buf := make([]byte, min(uint64(cfg.BufferSize), max(p.TotalBytes, 1)))
	h := checksum.New()
	var bad []*entry
	var rep VerifyReport
	last := start
	for _, e := range entries {
		h.Reset()
		var rerr error
		for off, n := e.offset, e.size; n > 0; {
			if err := ctx.Err(); err != nil {
				return rep, fmt.Errorf("verify segment %s: %w", s.id, err)
			}
			k := min(n, uint64(len(buf)))
			if rerr = s.store.readAt(buf[:k], off); rerr != nil {
				break
			}
			_, _ = h.Write(buf[:k])
			off += k
			n -= k
			p.VerifiedBytes += k
			if now := cfg.Now(); cfg.Progress != nil && now.Sub(last) >= cfg.ProgressEvery {
				last = now
				p.Elapsed = now.Sub(start)
				cfg.Progress(p)
			}
		}
		p.Allocations++
		switch {
		case rerr != nil && !errors.Is(rerr, syscall.EIO):
			return rep, fmt.Errorf("verify segment %s: read allocation %d: %w", s.id, e.id, rerr)
		case rerr != nil:
			bad = append(bad, e)
			rep.addCorrupt(e, 0, rerr)
		default:
			if sum := h.Sum64(); sum != e.checksum {
				bad = append(bad, e)
				rep.addCorrupt(e, sum, nil)
			}
		}
		p.Corrupt = len(bad)
	}
	rep.Allocations, rep.Bytes = p.Allocations, p.VerifiedBytes
	if err := s.dropCorrupt(bad); err != nil {
		return rep, err
	}
	rep.Took = cfg.Now().Sub(start)
	if cfg.Progress != nil {
		p.Elapsed = rep.Took
		cfg.Progress(p)
	}
	return rep, nil
}

func (r *VerifyReport) addCorrupt(e *entry, got uint64, err error) {
	r.CorruptCount++
	if len(r.Corrupt) < MaxCorruptDetails {
		r.Corrupt = append(r.Corrupt, CorruptAllocation{ID: e.id, Offset: e.offset, Size: e.size, Tenant: e.tenant, Key: e.key,
			ReplicaID: e.replica, Want: e.checksum, Got: got, Err: err})
	}
}

// dropCorrupt removes bad (sealed entries found corrupt) from the table,
// journals and syncs their releases, and remembers their ids so reads of
// them answer CHECKSUM_MISMATCH.
func (s *Segment) dropCorrupt(bad []*entry) error {
	if len(bad) == 0 {
		return nil
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return errClosed
	}
	var jerr error
	for _, e := range bad {
		if cur, ok := s.table.get(e.id); !ok || cur != e {
			continue // released meanwhile
		}
		if err := s.dropLocked(e, jerr == nil); jerr == nil {
			jerr = err
		}
	}
	s.mu.Unlock()
	if jerr == nil && s.jrn != nil {
		jerr = s.jrn.sync(time.Now().UnixMilli())
	}
	if jerr != nil {
		return fmt.Errorf("verify segment %s: journal the release of corrupt allocations: %w", s.id, jerr)
	}
	return nil
}

// errCorruptAllocation answers a read of an allocation VerifySealed or a
// read (lose) dropped.
func errCorruptAllocation(seg string, id uint64) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_CHECKSUM_MISMATCH,
		"allocation %d of segment %s failed its checksum check or could not be read; its bytes are not served", id, seg)
}
