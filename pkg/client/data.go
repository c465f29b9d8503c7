package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/retry"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
)

// source yields the object's bytes [off, off+n): for an in-memory object a
// sub-slice (no copy), for a file a read into buf.
type source func(off int64, n int, buf []byte) ([]byte, error)

func sliceSource(b []byte) source {
	return func(off int64, n int, _ []byte) ([]byte, error) { return b[off : off+int64(n)], nil }
}

func readerSource(r io.ReaderAt) source {
	return func(off int64, n int, buf []byte) ([]byte, error) {
		if cap(buf) < n {
			buf = make([]byte, n)
		}
		buf = buf[:n]
		if _, err := r.ReadAt(buf, off); err != nil && !(errors.Is(err, io.EOF)) {
			return nil, err
		}
		return buf, nil
	}
}

// Put stores data under key. It returns after PutEnd: the object is then
// readable on every replica. On any failure the put is revoked. A Put whose
// context ends while its PutEnd is in flight may still store the object
// (the master may have committed it); a put on a spare (spare.go) exists at
// the master only from that commit.
func (c *Client) Put(ctx context.Context, key string, data []byte, opts ...PutOption) error {
	return c.put(ctx, key, int64(len(data)), sliceSource(data), sumAside(data), newPutOptions(c, opts))
}

// objectSum is a put's object checksum, known or being computed.
type objectSum struct {
	v    uint64
	done chan struct{} // nil when v is known; closed once it is
}

func knownSum(v uint64) *objectSum { return &objectSum{v: v} }

// asideSum is the size from which Put hashes the object in a goroutine of
// its own while PutStart is in flight (the master's answer waits on the
// agent's Reserve, longer than hashing 1 MiB takes) instead of before it:
// below it the goroutine costs more than the hashing.
const asideSum = 256 << 10

// sumAside returns data's checksum: computed at once for a small object,
// in the background for a large one (get waits for it).
func sumAside(data []byte) *objectSum {
	if len(data) < asideSum {
		return knownSum(checksum.Sum(data))
	}
	s := &objectSum{done: make(chan struct{})}
	go func() {
		s.v = checksum.Sum(data)
		close(s.done)
	}()
	return s
}

// get returns the checksum once it is known.
func (s *objectSum) get() uint64 {
	if s.done != nil {
		<-s.done
	}
	return s.v
}

// PutFrom stores size bytes read from r under key without holding the whole
// object in memory (r is read twice: once for the checksum, then per replica).
func (c *Client) PutFrom(ctx context.Context, key string, r io.ReaderAt, size int64, opts ...PutOption) error {
	h := checksum.New()
	if _, err := io.Copy(h, io.NewSectionReader(r, 0, size)); err != nil {
		return fmt.Errorf("put %q: read source: %w", key, err)
	}
	return c.put(ctx, key, size, readerSource(r), knownSum(h.Sum64()), newPutOptions(c, opts))
}

func (c *Client) put(ctx context.Context, key string, size int64, src source, sum *objectSum, o *putOptions) (err error) {
	// Whatever happens, the caller's bytes are not read after Put returns.
	defer sum.get()
	ctx, span := c.startCall(ctx, "client.put", 1, size, key)
	defer func() { tracectx.End(span, err) }()
	err = c.putOnce(ctx, key, size, src, sum, o)
	var again *putAgain
	if errors.As(err, &again) {
		// Not acknowledged, and nothing of it kept: put it again, once.
		return c.putOnce(ctx, key, size, src, sum, o)
	}
	return err
}

// putAgain is putOnce's error for a put the master did not acknowledge
// and that a second PutStart may well place where it can be stored:
//   - PutEnd found no put to end on a master other than the one that
//     started it (a failover between PutStart and PutEnd: issue 15);
//   - the master had dropped the put before its PutEnd (PUT_EXPIRED):
//     every replica's segment went away while the client wrote (its agent
//     lost, or cut off past the master's --unmount-after), or the put
//     outlived the put timeout; nothing of it was kept;
//   - a segment could not seal any replica (SEGMENT_UNAVAILABLE: a disk
//     segment whose journal cannot be written); the master dropped the
//     put, and that segment takes no new put until it can seal again.
type putAgain struct{ err error }

func (e *putAgain) Error() string { return e.err.Error() }
func (e *putAgain) Unwrap() error { return e.err }

// endAgain reports whether a PutEnd that failed with err, on the master
// endedAt where the put started at startedAt, is worth a second put.
func endAgain(err error, startedAt, endedAt string) bool {
	if errors.Is(err, ErrPutExpired) || (endedAt != startedAt && errors.Is(err, ErrNotFound)) {
		return true
	}
	return rpcerr.Reason(err) == "SEGMENT_UNAVAILABLE"
}

func (c *Client) putOnce(ctx context.Context, key string, size int64, src source, objSum *objectSum, o *putOptions) error {
	var spares uint32
	if c.spareEligible(key, size, o) {
		if d := c.s.spares.take(uint64(size), time.Now()); d != nil {
			err := c.putOnSpare(ctx, key, size, src, objSum, o, d)
			var gone *errSpareGone
			if !errors.As(err, &gone) {
				if err != nil {
					return fmt.Errorf("put %q: %w", key, err)
				}
				return nil
			}
			// Nothing committed: put through PutStart.
		}
		spares = c.s.spares.want(uint64(size))
	}
	start, err := c.putStart(ctx, &masterv1.PutStartRequest{
		Tenant: c.tenant, Key: key, Size: uint64(size), Config: o.cfg, ClientId: c.s.cfg.ClientID, Upsert: o.upsert, Spares: spares,
	})
	if err != nil {
		if abandoned(err) {
			// The master may have started the put before the caller gave
			// up; revoke so the key is not held until preemption.
			c.revoke(ctx, key)
		}
		return fmt.Errorf("put %q: %w", key, err)
	}
	startedAt, _ := c.s.masters.current() // the master that answered PutStart
	c.s.spares.keep(start.GetSpares())
	sum := objSum.get()
	var (
		mu   sync.Mutex // replicas are written in parallel
		done int64
	)
	total := size * int64(len(start.GetReplicas()))
	progress := func(n int) {
		if o.progress != nil {
			mu.Lock()
			done += int64(n)
			o.progress(done, total)
			mu.Unlock()
		}
	}
	var rc *sealReceipts
	if !c.s.cfg.DisableSealOnWrite {
		rc = &sealReceipts{sum: sum}
	}
	if err := c.writeReplicas(ctx, start.GetReplicas(), size, src, progress, rc); err != nil {
		c.revoke(ctx, key)
		return fmt.Errorf("put %q: write replica: %w", key, err)
	}
	if _, err := c.putEnd(ctx, &masterv1.PutEndRequest{Tenant: c.tenant, Key: key, ClientId: c.s.cfg.ClientID, Checksum: sum, SealReceipts: rc.receipts()}); err != nil {
		if !errors.Is(err, ErrChecksum) {
			c.revoke(ctx, key)
		}
		err = fmt.Errorf("put %q: %w", key, err)
		if endedAt, _ := c.s.masters.current(); endAgain(err, startedAt, endedAt) {
			return &putAgain{err}
		}
		return err
	}
	if endedAt, _ := c.s.masters.current(); endedAt != startedAt {
		if short := c.fewerReplicas(ctx, []string{key}, o); short[0] != nil {
			return fmt.Errorf("put %q: %w", key, short[0])
		}
	}
	return nil
}

// fewerReplicas checks puts whose PutEnd a master other than the one that
// started them answered (a failover between the two): the new leader
// knows only the replicas the agents had sealed, and answers a PutEnd for
// an object it holds complete with OK however few they are. It returns,
// per key, ErrFewerReplicas when the object has fewer readable replicas
// than o asks for (nil otherwise, or when the check itself failed: the
// object is stored either way).
func (c *Client) fewerReplicas(ctx context.Context, keys []string, o *putOptions) []error {
	out := make([]error, len(keys))
	want := max(int(o.cfg.GetReplicaNum()), 1)
	if want == 1 {
		return out
	}
	req := &masterv1.BatchGetReplicaListRequest{Items: make([]*masterv1.GetReplicaListRequest, len(keys))}
	for i, k := range keys {
		req.Items[i] = &masterv1.GetReplicaListRequest{Tenant: c.tenant, Key: k}
	}
	resp, err := call(c, func(s masterv1.ObjectServiceClient) (*masterv1.BatchGetReplicaListResponse, error) {
		return s.BatchGetReplicaList(ctx, req)
	})
	if err != nil || len(resp.GetResults()) != len(keys) {
		return out
	}
	for i, r := range resp.GetResults() {
		if n := len(r.GetReplicaList().GetReplicas()); rpcerr.FromItem(r.GetStatus()) == nil && n < want {
			out[i] = fmt.Errorf("%w: %d of %d", ErrFewerReplicas, n, want)
		}
	}
	return out
}

// abandoned reports whether a call failed because the caller's context
// ended (so the server may still have acted on it).
func abandoned(err error) bool {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var e *rpcerr.Error
	return errors.As(err, &e) && (e.Code() == codes.Canceled || e.Code() == codes.DeadlineExceeded)
}

// revoke abandons a started put even when ctx is already cancelled.
func (c *Client) revoke(ctx context.Context, key string) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_, _ = c.Objects().PutRevoke(rctx, &masterv1.PutRevokeRequest{Tenant: c.tenant, Key: key, ClientId: c.s.cfg.ClientID})
}

// writeReplicas writes every replica in parallel and returns the first error.
func (c *Client) writeReplicas(ctx context.Context, reps []*masterv1.ReplicaDescriptor, size int64, src source, progress func(int), rc *sealReceipts) error {
	if len(reps) == 1 {
		return c.writeOne(ctx, reps[0], size, src, progress, rc)
	}
	errs := make([]error, len(reps))
	var wg sync.WaitGroup
	for i, d := range reps {
		wg.Go(func() { errs[i] = c.writeOne(ctx, d, size, src, progress, rc) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// sealReceipts collects the seal receipts of one put's replica writes
// (internal/token/receipt.go): the agents seal on write the replicas
// written whole in one bulk request and vouch for it, and PutEnd passes
// the receipts so the master sends those agents no Seal. Safe for the
// concurrent writes of the replicas.
type sealReceipts struct {
	sum uint64 // the object checksum
	mu  sync.Mutex
	got [][]byte // guarded by mu
}

// receipts returns the receipts collected (nil for a nil rc).
func (rc *sealReceipts) receipts() [][]byte {
	if rc == nil {
		return nil
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return rc.got
}

func (rc *sealReceipts) add(r []byte) {
	if rc == nil || len(r) == 0 {
		return
	}
	rc.mu.Lock()
	rc.got = append(rc.got, r)
	rc.mu.Unlock()
}

// writeOne writes one replica; rc, when not nil, asks the agent to seal
// it on write and collects its receipt.
func (c *Client) writeOne(ctx context.Context, d *masterv1.ReplicaDescriptor, size int64, src source, progress func(int), rc *sealReceipts) error {
	if ep := c.transferEndpoint(d); ep != "" {
		return c.writeTransfer(ctx, ep, d, size, src, progress, rc)
	}
	dc, err := c.agent(d.GetDataEndpoint())
	if err != nil {
		return err
	}
	if size <= int64(c.s.cfg.SmallObject) {
		data, err := src(0, int(size), nil)
		if err != nil {
			return err
		}
		resp, err := dc.BatchWrite(ctx, &agentv1.BatchWriteRequest{Items: []*agentv1.BatchWriteItem{{
			SegmentId: d.GetSegmentId(), AllocationId: d.GetAllocationId(), Token: d.GetToken(), Data: data,
		}}})
		if err != nil {
			return rpcerr.FromStatus(err)
		}
		if len(resp.GetResults()) != 1 {
			return fmt.Errorf("agent %s: %d results for 1 item", d.GetDataEndpoint(), len(resp.GetResults()))
		}
		if err := itemErr(resp.GetResults()[0]); err != nil {
			return err
		}
		progress(int(size))
		return nil
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := dc.Write(ctx)
	if err != nil {
		return rpcerr.FromStatus(err)
	}
	chunk := int64(c.s.cfg.ChunkSize)
	buf := make([]byte, 0, min(chunk, size))
	for off := int64(0); off < size; off += chunk {
		n := min(chunk, size-off)
		data, err := src(off, int(n), buf)
		if err != nil {
			return err
		}
		req := &agentv1.WriteRequest{Data: data}
		if off == 0 {
			req.Header = &agentv1.WriteHeader{SegmentId: d.GetSegmentId(), AllocationId: d.GetAllocationId(), Token: d.GetToken()}
		}
		if err := stream.Send(req); err != nil {
			// The real error is in the status returned by CloseAndRecv.
			_, rerr := stream.CloseAndRecv()
			if rerr == nil {
				rerr = err
			}
			return rpcerr.FromStatus(rerr)
		}
		progress(int(n))
	}
	resp, err := stream.CloseAndRecv()
	if err != nil {
		return rpcerr.FromStatus(err)
	}
	if resp.GetBytesWritten() != uint64(size) {
		return fmt.Errorf("agent %s wrote %d of %d bytes", d.GetDataEndpoint(), resp.GetBytesWritten(), size)
	}
	return nil
}

func itemErr(r *agentv1.ItemResult) error {
	if codes.Code(r.GetCode()) == codes.OK {
		return nil
	}
	return rpcerr.FromItem(&masterv1.ItemStatus{Code: r.GetCode(), Reason: r.GetReason(), Message: r.GetMessage()})
}

// Get returns the object's bytes.
func (c *Client) Get(ctx context.Context, key string) ([]byte, error) {
	var out []byte
	err := c.get(ctx, key, func(size uint64) ([]byte, error) {
		out = make([]byte, size)
		return out, nil
	}, func(b []byte) { out = b })
	return out, err
}

// GetInto reads the object into buf (which must be large enough) with no
// extra copy of the whole object, and returns its size.
func (c *Client) GetInto(ctx context.Context, key string, buf []byte) (int, error) {
	var n int
	err := c.get(ctx, key, func(size uint64) ([]byte, error) {
		if uint64(len(buf)) < size {
			return nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "buffer of %d bytes is smaller than object %q of %d bytes", len(buf), key, size)
		}
		n = int(size)
		return buf[:size], nil
	}, nil)
	return n, err
}

// get fetches the replica list and reads the nearest good replica into the
// buffer alloc returns (or, with keep, into a buffer of the batch's that
// keep takes: getQ). If every replica fails and the lease may have run
// out, it fetches a fresh list once.
func (c *Client) get(ctx context.Context, key string, alloc func(size uint64) ([]byte, error), keep func([]byte)) (err error) {
	ctx, span := c.startCall(ctx, "client.get", 1, -1, key)
	defer func() { tracectx.End(span, err) }()
	return c.getCoalesced(ctx, key, alloc, keep) // coalesce.go
}

// getDirect is get on its own; with rl, the first round reads from that
// replica list instead of fetching one.
func (c *Client) getDirect(ctx context.Context, key string, alloc func(size uint64) ([]byte, error), rl *masterv1.GetReplicaListResponse) error {
	if rl == nil {
		var err error
		if rl, err = c.replicaList(ctx, key); err != nil {
			return fmt.Errorf("get %q: %w", key, err)
		}
	}
	buf, err := alloc(rl.GetSize())
	if err != nil {
		return err
	}
	if err := c.readAny(ctx, rl, rl.GetReplicas(), buf); err != nil {
		return c.getAgain(ctx, key, alloc, err)
	}
	return nil
}

// getAgain is a get's second and last round, after every replica of its
// first list failed (first): a fresh list (freshList), read into the
// buffer alloc returns.
func (c *Client) getAgain(ctx context.Context, key string, alloc func(size uint64) ([]byte, error), first error) error {
	rl, err := c.freshList(ctx, key, first)
	if err != nil {
		return err
	}
	buf, err := alloc(rl.GetSize())
	if err != nil {
		return err
	}
	if err := c.readAny(ctx, rl, rl.GetReplicas(), buf); err != nil {
		return fmt.Errorf("get %q: %w (the first read: %w)", key, err, first)
	}
	return nil
}

// freshList fetches the replica list of a get's second round, after its
// first round failed with first (Get, the batch gets, GetTo). It may differ
// from the first list: the tokens of that one may have expired while an
// agent stalled, a replica found bad may have been dropped
// (verifyReplica), the object may have moved or been replaced. Its errors
// are the get's: ctx done (first), or the list's failure naming first too
// (a list that says OBJECT_NOT_FOUND after the first read found the only
// replica bad, and the agent dropped it, is still a checksum failure to
// the caller).
func (c *Client) freshList(ctx context.Context, key string, first error) (*masterv1.GetReplicaListResponse, error) {
	if ctx.Err() != nil {
		return nil, fmt.Errorf("get %q: %w", key, first)
	}
	if rpcerr.Reason(first) == "INVALID_TOKEN" {
		// A master of before SettingsApplied, just (re)started or newly
		// elected, made a registering agent's segments readable as it
		// sent the agent its token keys, so for a moment the agent might
		// not know the key of a fresh list's tokens, and refetching at
		// once met the same agent still without it (CI,
		// TestPutsOnBlankReservations). Masters now wait for the agent's
		// answer; the pause stays for older ones and costs nothing
		// otherwise.
		_ = retry.Sleep(ctx, tokenRetryPause)
	}
	rl, err := c.replicaList(ctx, key)
	if err != nil {
		return nil, fmt.Errorf("get %q: %w (the first read: %w)", key, err, first)
	}
	return rl, nil
}

// tokenRetryPause is how long a Get whose replicas refused their tokens
// waits before it fetches a fresh replica list.
const tokenRetryPause = 25 * time.Millisecond

func (c *Client) replicaList(ctx context.Context, key string) (*masterv1.GetReplicaListResponse, error) {
	rl, err := c.s.co.lists.do(ctx, &masterv1.GetReplicaListRequest{Tenant: c.tenant, Key: key, ClientHost: c.s.cfg.HostID})
	if err != nil {
		return nil, err
	}
	c.orderReplicas(rl.GetReplicas())
	return rl, nil
}

// orderReplicas puts replicas on this host first, keeping the master's order
// otherwise.
func (c *Client) orderReplicas(reps []*masterv1.ReplicaDescriptor) {
	host := c.s.cfg.HostID
	slices.SortStableFunc(reps, func(a, b *masterv1.ReplicaDescriptor) int {
		la, lb := a.GetHostId() == host, b.GetHostId() == host
		switch {
		case la && !lb:
			return -1
		case lb && !la:
			return 1
		}
		return 0
	})
}

// readAny tries each replica in order until one returns bytes matching the
// checksum.
func (c *Client) readAny(ctx context.Context, rl *masterv1.GetReplicaListResponse, reps []*masterv1.ReplicaDescriptor, buf []byte) error {
	if len(reps) == 0 {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_REPLICA_IS_NOT_READY, "no readable replica")
	}
	var errs []error
	for _, d := range reps {
		if c.readMapped(d, buf, rl.GetChecksum()) {
			return nil
		}
		err := c.readOne(ctx, d, buf)
		if err == nil && checksum.Sum(buf) != rl.GetChecksum() {
			err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_CHECKSUM_MISMATCH, "replica %d on %s: checksum mismatch", d.GetReplicaId(), d.GetDataEndpoint())
			defer c.verifyReplica(ctx, d) // after the other replicas were tried
		}
		if err == nil {
			return nil
		}
		errs = append(errs, fmt.Errorf("replica %d on %s: %w", d.GetReplicaId(), d.GetDataEndpoint(), err))
		if ctx.Err() != nil {
			break
		}
	}
	if len(errs) == 1 {
		return errs[0]
	}
	return errors.Join(errs...)
}

// verifyTimeout bounds verifyReplica.
const verifyTimeout = 5 * time.Second

// verifyReplica asks d's agent to check the replica whose bytes failed
// their checksum here (TRANSFER_OP_VERIFY on the bulk path, where the read
// went, DataService.Verify on the gRPC one): the agent reads the
// allocation again itself and, when its bytes are bad, drops it and
// reports it lost, so that the master stops handing it out and the event
// stream retracts it. The agent trusts its own reading: when the bytes
// went wrong on the way here, nothing changes. Best effort and synchronous
// (a get that met a bad replica is rare, and once the agent dropped it
// nobody meets it again), within verifyTimeout; an agent that predates
// VERIFY does not answer (the bulk path) or answers Unimplemented (gRPC),
// both ignored.
func (c *Client) verifyReplica(ctx context.Context, d *masterv1.ReplicaDescriptor) {
	if ctx.Err() != nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, verifyTimeout)
	defer cancel()
	if ep := c.transferEndpoint(d); ep != "" {
		_, _ = c.s.xfer.Verify(ctx, ep, []*agentv1.TransferItem{transferItem(d, 0)})
		return
	}
	dc, err := c.agent(d.GetDataEndpoint())
	if err != nil {
		return
	}
	_, _ = dc.Verify(ctx, &agentv1.VerifyRequest{Items: []*agentv1.BatchReadItem{{SegmentId: d.GetSegmentId(), AllocationId: d.GetAllocationId(), Token: d.GetToken()}}})
}

// readOne reads one replica into buf (len(buf) == object size).
func (c *Client) readOne(ctx context.Context, d *masterv1.ReplicaDescriptor, buf []byte) error {
	if ep := c.transferEndpoint(d); ep != "" {
		return c.readTransfer(ctx, ep, d, int64(len(buf)), buf, nil)
	}
	dc, err := c.agent(d.GetDataEndpoint())
	if err != nil {
		return err
	}
	if len(buf) <= c.s.cfg.SmallObject {
		resp, err := dc.BatchRead(ctx, &agentv1.BatchReadRequest{Items: []*agentv1.BatchReadItem{{
			SegmentId: d.GetSegmentId(), AllocationId: d.GetAllocationId(), Token: d.GetToken(),
		}}})
		if err != nil {
			return rpcerr.FromStatus(err)
		}
		if len(resp.GetResults()) != 1 {
			return fmt.Errorf("%d results for 1 item", len(resp.GetResults()))
		}
		r := resp.GetResults()[0]
		if err := itemErr(r.GetStatus()); err != nil {
			return err
		}
		if len(r.GetData()) != len(buf) {
			return fmt.Errorf("got %d bytes, want %d", len(r.GetData()), len(buf))
		}
		copy(buf, r.GetData())
		return nil
	}
	return c.readStream(ctx, d.GetDataEndpoint(), d, func(off int64, p []byte) error {
		if off+int64(len(p)) > int64(len(buf)) {
			return fmt.Errorf("agent sent more than %d bytes", len(buf))
		}
		copy(buf[off:], p)
		return nil
	}, int64(len(buf)))
}

// readStream streams a replica and hands each chunk to sink in order. It
// decodes chunks with readCodec, straight from the transport's buffers.
func (c *Client) readStream(ctx context.Context, endpoint string, d *masterv1.ReplicaDescriptor, sink func(off int64, p []byte) error, size int64) error {
	if ep := c.transferEndpoint(d); ep != "" {
		return c.readTransfer(ctx, ep, d, size, nil, sink)
	}
	cc, err := c.agentConn(endpoint)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := cc.NewStream(ctx, &readStreamDesc, agentv1.DataService_Read_FullMethodName, grpc.ForceCodecV2(readCodec{}))
	if err != nil {
		return rpcerr.FromStatus(err)
	}
	if err := stream.SendMsg(&agentv1.ReadRequest{
		SegmentId: d.GetSegmentId(), AllocationId: d.GetAllocationId(), Token: d.GetToken(), ChunkSize: uint32(c.s.cfg.ChunkSize),
	}); err != nil {
		return rpcerr.FromStatus(err)
	}
	if err := stream.CloseSend(); err != nil {
		return rpcerr.FromStatus(err)
	}
	var off int64
	rs := &readSink{put: func(p []byte) error {
		if err := sink(off, p); err != nil {
			return err
		}
		off += int64(len(p))
		return nil
	}}
	for {
		err := stream.RecvMsg(rs)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return rpcerr.FromStatus(err)
		}
	}
	if off != size {
		return fmt.Errorf("got %d bytes, want %d", off, size)
	}
	return nil
}

// readStreamDesc describes DataService.Read for NewStream.
var readStreamDesc = grpc.StreamDesc{StreamName: "Read", ServerStreams: true}

// GetTo streams the object into w without buffering it whole, verifying the
// checksum at the end, and returns the bytes written (those left in w).
//
// Replicas are tried in order. A replica that fails before its first byte
// reaches w (unreachable, refusing) is skipped whatever w is. One that fails
// after (a read error part-way, or a checksum mismatch, only known at the
// end) depends on w:
//   - when w can be rewound — it implements Seek and Truncate(int64) error,
//     and seeking to its current offset works when GetTo starts, as for an
//     *os.File on a regular file — GetTo truncates w back to that offset,
//     seeks there and tries the next replica; progress starts again from 0.
//     Anything w held past that offset is lost on such a rewind.
//   - otherwise (a pipe, a terminal, a bytes.Buffer) GetTo stops with that
//     replica's error and the bytes written stay in w.
//
// A failed write to w ends GetTo at once. When every replica failed, the
// error names each replica's.
func (c *Client) GetTo(ctx context.Context, key string, w io.Writer, progress func(done, total int64)) (_ int64, err error) {
	ctx, span := c.startCall(ctx, "client.get", 1, -1, key)
	defer func() { tracectx.End(span, err) }()
	rw, start, rewindable := rewinderOf(w)
	rl, err := c.replicaList(ctx, key)
	if err != nil {
		return 0, fmt.Errorf("get %q: %w", key, err)
	}
	size := int64(rl.GetSize())
	h := checksum.New()
	var (
		written int64
		werr    error // w's, which no other replica can help
	)
	sink := func(_ int64, p []byte) error {
		_, _ = h.Write(p)
		n, err := w.Write(p)
		written += int64(n)
		if progress != nil {
			progress(written, size)
		}
		if err != nil {
			werr = err
		}
		return err
	}
	// bad: replicas whose bytes failed their checksum, for verifyReplica
	// once the others were tried.
	var bad []*masterv1.ReplicaDescriptor
	verifyBad := func() {
		for _, d := range bad {
			c.verifyReplica(ctx, d)
		}
		bad = nil
	}
	defer verifyBad()
	// try reads rl's replicas in turn into w. done: the get is over (read,
	// or a failure no other replica can help); otherwise err joins the
	// replicas' failures.
	try := func(rl *masterv1.GetReplicaListResponse) (n int64, err error, done bool) {
		var errs []error
		for _, d := range rl.GetReplicas() {
			h.Reset()
			written, werr = 0, nil
			err := c.readStream(ctx, d.GetDataEndpoint(), d, sink, size)
			if werr != nil {
				return written, fmt.Errorf("get %q: write: %w", key, werr), true
			}
			if err == nil && h.Sum64() != rl.GetChecksum() {
				err = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_CHECKSUM_MISMATCH, "checksum mismatch")
				bad = append(bad, d)
			}
			if err == nil {
				return written, nil, true
			}
			err = fmt.Errorf("replica %d on %s: %w", d.GetReplicaId(), d.GetDataEndpoint(), err)
			if written > 0 {
				if !rewindable {
					return written, fmt.Errorf("get %q: %w (%d bytes written)", key, err, written), true
				}
				if rerr := rewind(rw, start); rerr != nil {
					return written, fmt.Errorf("get %q: %w (%d bytes written; %w)", key, err, written, rerr), true
				}
				if progress != nil {
					progress(0, size)
				}
			}
			errs = append(errs, err)
			if ctx.Err() != nil {
				break
			}
		}
		if len(errs) == 0 {
			errs = append(errs, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_REPLICA_IS_NOT_READY, "no readable replica"))
		}
		return 0, errors.Join(errs...), false
	}
	n, first, done := try(rl)
	if done {
		return n, first
	}
	// As Get does (getAgain): a fresh list once, which lacks a replica
	// found bad when its agent dropped it.
	verifyBad()
	if rl, err = c.freshList(ctx, key, first); err != nil {
		return 0, err
	}
	size = int64(rl.GetSize())
	n, err, done = try(rl)
	if done {
		return n, err
	}
	return 0, fmt.Errorf("get %q: %w (the first read: %w)", key, err, first)
}

// rewinder is a writer GetTo can take back to where it started writing.
type rewinder interface {
	io.Seeker
	Truncate(size int64) error
}

// rewinderOf returns w as a rewinder and its current offset, when w is one
// and seeking works on it (it does not on an *os.File that is a pipe or a
// terminal).
func rewinderOf(w io.Writer) (rewinder, int64, bool) {
	rw, ok := w.(rewinder)
	if !ok {
		return nil, 0, false
	}
	off, err := rw.Seek(0, io.SeekCurrent)
	if err != nil {
		return nil, 0, false
	}
	return rw, off, true
}

// rewind drops what was written to rw past off and moves back there.
func rewind(rw rewinder, off int64) error {
	if err := rw.Truncate(off); err != nil {
		return fmt.Errorf("rewind: %w", err)
	}
	if _, err := rw.Seek(off, io.SeekStart); err != nil {
		return fmt.Errorf("rewind: %w", err)
	}
	return nil
}
