package meta

import (
	"errors"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
)

// Seal receipts (issue 18 item 2). An agent that verified and sealed an
// allocation as the client's bulk write of it completed answers a seal
// receipt (internal/token/receipt.go), a MAC under a key derived from this
// master's token keys over (segment, allocation, size, checksum, the
// master epoch of the Reserve). The client passes it in PutEnd; BatchPutEnd
// commits a replica with a valid receipt as if the agent had answered its
// Seal OK, without the Seal round trip (which woke the agent's session and
// cost a put a quarter of its time on a 1 MiB object). Replicas without a
// receipt are sealed by Seal as before.
//
// A receipt that does not hold is never skipped over: the put fails with
// the receipt's error and its replicas are removed and released (the
// agent's sealed allocations with them), so nothing a client cannot prove
// becomes readable. A receipt that holds but names an allocation that is
// not (or no longer) a replica of the put vouches for nothing and is
// skipped. The refusals:
//
//   - malformed, naming a size or checksum other than the put's, or
//     naming one of its replicas twice: INVALID_ARGUMENT INVALID_PARAMS;
//   - a MAC that does not verify under the keys agents hold: PERMISSION_DENIED
//     INVALID_TOKEN;
//   - reserved under another master epoch: FAILED_PRECONDITION STALE_EPOCH.

// maxReceipts bounds the receipts of one PutEnd (one per replica).
const maxReceipts = 64

// openedReceipt is one receipt whose MAC verified.
type openedReceipt struct{ token.Receipt }

// openReceipts verifies the receipts' MACs (outside any lock) for the put
// of tenant's key: a version 2 receipt (a spare's write) is bound to it,
// and a spare's commit takes no other.
func (s *Store) openReceipts(raw [][]byte, tenant, key string, spare bool) ([]openedReceipt, error) {
	if len(raw) > maxReceipts {
		return nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
			"a PutEnd carries at most %d seal receipts (one per replica), this one %d", maxReceipts, len(raw))
	}
	rk := s.keys.ReceiptKeys()
	out := make([]openedReceipt, len(raw))
	for i, b := range raw {
		r, err := rk.OpenObject(b, tenant, key)
		switch {
		case errors.Is(err, token.ErrMalformed):
			return nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "seal receipt %d is malformed (%d bytes)", i, len(b))
		case errors.Is(err, token.ErrUnknownKey):
			return nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_TOKEN,
				"seal receipt %d names key id %d, which this master does not hold (rotated out, or another master's)", i, r.KeyID)
		case err != nil:
			return nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_TOKEN, "seal receipt %d does not verify: not made by an agent of this master", i)
		}
		if spare && r.Key == "" {
			return nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
				"seal receipt %d is not bound to an object (version 1): a spare's write answers a version 2 receipt", i)
		}
		out[i].Receipt = r
	}
	return out, nil
}

// applyReceiptsLocked matches it's opened receipts with its replicas (o's,
// collected in it.reps) and marks the replicas they vouch for. A receipt
// that did not open, or names no replica of the put, or another size,
// checksum or epoch, fails every replica of the put with its error, so settleSealsLocked
// removes and releases them all. The shard's lock is held.
func (s *Store) applyReceiptsLocked(it *endItem, o *object, sp *PutEndSpec) {
	err := it.receiptErr
	if err == nil {
		err = s.matchReceiptsLocked(it, o, sp)
	}
	if err == nil {
		return
	}
	for r := range it.reps {
		it.reps[r].err, it.reps[r].receipted = err, false
	}
	it.receiptErr = err // the put's error should no replica be left to fail
}

func (s *Store) matchReceiptsLocked(it *endItem, o *object, sp *PutEndSpec) error {
	epoch := s.Epoch()
	for k := range it.receipts {
		rc := &it.receipts[k]
		switch {
		case rc.Epoch != epoch:
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_STALE_EPOCH,
				"seal receipt %d is for an allocation reserved under master epoch %d; this master's is %d", k, rc.Epoch, epoch)
		case rc.Size != o.size:
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
				"seal receipt %d vouches for %d bytes; the put of %q/%q is %d", k, rc.Size, sp.Tenant, sp.Key, o.size)
		case rc.Checksum != sp.Checksum:
			return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
				"seal receipt %d vouches for checksum %#x; PutEnd names %#x", k, rc.Checksum, sp.Checksum)
		}
		seg, ok := s.segs.lookup(rc.SegmentID)
		for r := range it.reps {
			rp := &it.reps[r]
			if ok && rp.seg == seg && rp.alloc == rc.AllocationID {
				if rp.receipted {
					return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
						"seal receipt %d names allocation %d of segment %s a second time", k, rc.AllocationID, rc.SegmentID)
				}
				rp.receipted = true
				break
			}
		}
		// A receipt that verified but names no replica of the put is
		// skipped: the put lost that replica while its bytes were on the
		// way (its agent was lost and its segments dropped: an agent
		// frozen past --unmount-after seals the write when it wakes, `make
		// soak`), and it vouches for nothing the put commits. Failing the
		// put for it (INVALID_PARAMS, as before) threw away the replicas
		// that did arrive.
	}
	return nil
}

// PutSeals reports how many replicas PutEnd has sealed or tried to seal
// through a seal receipt and through a Seal to the agent
// (crescent_master_put_seals_total).
func (s *Store) PutSeals() (viaReceipt, viaSeal uint64) {
	return s.sealsByReceipt.Load(), s.sealsBySeal.Load()
}
