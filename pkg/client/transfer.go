package client

import (
	"context"
	"fmt"
	"slices"

	"github.com/crescent-kv/crescent/internal/checksum"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
)

// Bytes travel on an agent's bulk transfer listener (internal/xfer) when the
// master's descriptor names one and Config.DisableTransfer is unset; gRPC
// DataService is the fallback for agents without one. One transfer request
// carries at most xferChunk bytes of one object, so a file put or a streamed
// get needs only one buffer of that size, while an in-memory object of up to
// xferChunk bytes moves in a single request straight from (or into) the
// caller's slice.
const xferChunk = 16 << 20

// transferEndpoint is where d's bytes move on the bulk path, or "" for
// DataService.
func (c *Client) transferEndpoint(d *masterv1.ReplicaDescriptor) string {
	if c.s.xfer == nil {
		return ""
	}
	return d.GetTransferEndpoint()
}

func transferItem(d *masterv1.ReplicaDescriptor, off int64) *agentv1.TransferItem {
	return &agentv1.TransferItem{SegmentId: d.GetSegmentId(), AllocationId: d.GetAllocationId(), Token: d.GetToken(), Offset: uint64(off)}
}

// writeTransfer writes a whole replica on the bulk path, xferChunk bytes per
// request. With rc, a replica that fits one request asks the agent to seal
// it on write (seal_checksum) and its receipt goes to rc.
func (c *Client) writeTransfer(ctx context.Context, ep string, d *masterv1.ReplicaDescriptor, size int64, src source, progress func(int), rc *sealReceipts) error {
	if rc != nil && size <= xferChunk {
		return c.writeSealed(ctx, ep, d, size, src, progress, rc)
	}
	var buf []byte
	// At least one request, so an empty object is written too.
	for off := int64(0); ; off += xferChunk {
		n := min(xferChunk, size-off)
		data, err := src(off, int(n), buf)
		if err != nil {
			return err
		}
		buf = data[:0]
		errs, err := c.xferWrite(ctx, ep, []*agentv1.TransferItem{transferItem(d, off)}, [][]byte{data})
		if err != nil {
			return err
		}
		if errs[0] != nil {
			return errs[0]
		}
		progress(int(n))
		if off+n >= size {
			return nil
		}
	}
}

// writeSealed writes a replica of at most xferChunk bytes in one bulk
// request (or one shared-memory grant) that asks the agent to seal it on
// write, and adds the agent's seal receipt to rc (none from an agent that
// predates receipts: the master's Seal then seals the replica at PutEnd).
func (c *Client) writeSealed(ctx context.Context, ep string, d *masterv1.ReplicaDescriptor, size int64, src source, progress func(int), rc *sealReceipts) error {
	data, err := src(0, int(size), nil)
	if err != nil {
		return err
	}
	it := transferItem(d, 0)
	it.SealChecksum = &rc.sum
	res, err := c.xferWriteSealed(ctx, ep, []*agentv1.TransferItem{it}, [][]byte{data})
	if err != nil {
		return err
	}
	if res[0].Err != nil {
		return res[0].Err
	}
	rc.add(res[0].Receipt)
	progress(int(size))
	return nil
}

// readTransfer reads [0, size) of a replica on the bulk path and hands it to
// sink in pieces of at most xferChunk bytes. With dst (len(dst) == size)
// the bytes land in dst itself; otherwise one buffer is reused.
func (c *Client) readTransfer(ctx context.Context, ep string, d *masterv1.ReplicaDescriptor, size int64, dst []byte, sink func(off int64, p []byte) error) error {
	var buf []byte
	for off := int64(0); off < size; off += xferChunk {
		n := min(xferChunk, size-off)
		var p []byte
		if dst != nil {
			p = dst[off : off+n]
		} else {
			if buf == nil {
				buf = make([]byte, min(xferChunk, size))
			}
			p = buf[:n]
		}
		res, err := c.xferRead(ctx, ep, []*agentv1.TransferItem{transferItem(d, off)}, [][]byte{p})
		if err != nil {
			return err
		}
		r := res[0]
		if r.Err != nil {
			return r.Err
		}
		if r.ObjectSize != uint64(size) {
			return fmt.Errorf("agent %s holds %d bytes, the master said %d", ep, r.ObjectSize, size)
		}
		if sink != nil {
			if err := sink(off, p); err != nil {
				return err
			}
		}
	}
	return nil
}

// batchWriteTransfer writes many small replicas to one agent in one request
// and reports each item's error through fail.
func (c *Client) batchWriteTransfer(ctx context.Context, ep string, chunk []write, fail func(int, error)) {
	items := make([]*agentv1.TransferItem, len(chunk))
	src := make([][]byte, len(chunk))
	for k, w := range chunk {
		items[k] = transferItem(w.desc, 0)
		src[k] = w.data
	}
	errs, err := c.xferWrite(ctx, ep, items, src)
	for k, w := range chunk {
		switch {
		case err != nil:
			fail(w.item, err)
		case errs[k] != nil:
			fail(w.item, errs[k])
		}
	}
}

// batchReadTransfer reads the first replica of each item from one agent —
// from this process's mapping of its segment when it has one, else in one
// request into one slab for the chunk — and returns the items that failed
// (error or checksum).
func (c *Client) batchReadTransfer(ctx context.Context, ep string, chunk []read, out [][]byte) []read {
	// Replicas this process maps are copied from the mapping, each into
	// the caller's buffer or one of its own; the rest go by request.
	asked := make([]read, 0, len(chunk)) // the reads that go by request
	var total uint64
	for _, r := range chunk {
		d, n := r.rl.GetReplicas()[0], r.rl.GetSize()
		if b, ok := c.appendMapped(d, r.dst[:0:len(r.dst)], n, r.rl.GetChecksum()); ok {
			out[r.item] = slices.Clip(b)
			continue
		}
		asked = append(asked, r)
		if r.dst == nil && !r.own {
			total += n
		}
	}
	if len(asked) == 0 {
		return nil
	}
	var slab []byte
	if total > 0 {
		slab = make([]byte, total)
	}
	items := make([]*agentv1.TransferItem, len(asked))
	dst := make([][]byte, len(asked))
	var off uint64
	for k, r := range asked {
		n := r.rl.GetSize()
		switch {
		case r.dst != nil:
			dst[k] = r.dst
		case r.own:
			dst[k] = make([]byte, n)
		default:
			dst[k] = slab[off : off+n : off+n]
			off += n
		}
		items[k] = transferItem(r.rl.GetReplicas()[0], 0)
	}
	chunk = asked
	res, err := c.xferRead(ctx, ep, items, dst)
	if err != nil {
		return failAll(chunk, err)
	}
	var failed []read
	for k, r := range chunk {
		if res[k].Err != nil {
			failed = append(failed, r.failedWith(res[k].Err))
			continue
		}
		if checksum.Sum(dst[k]) != r.rl.GetChecksum() {
			failed = append(failed, r.failedWith(errChecksum))
			continue
		}
		out[r.item] = dst[k]
	}
	return failed
}
