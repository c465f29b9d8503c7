package dataplane

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
)

// xenv is a transfer listener on loopback TCP over one memory and one disk
// segment, with a client pool.
type xenv struct {
	mem, disk *segment.Segment
	keys      *Keyring
	key       token.SigningKey
	srv       *Server
	addr      string
	pool      *xfer.Pool
	cancel    context.CancelFunc
	done      chan error
}

func startTransfer(t testing.TB, cfg TransferConfig) *xenv {
	t.Helper()
	return startTransferOn(t, cfg, nil)
}

// startTransferOn is startTransfer with the listener wrapped by wrap (when
// not nil).
func startTransferOn(t testing.TB, cfg TransferConfig, wrap func(net.Listener) net.Listener) *xenv {
	t.Helper()
	mem, disk, set, keys, key, srv := newTestServer(t, Config{Transfer: cfg})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if wrap != nil {
		lis = wrap(lis)
	}
	ctx, cancel := context.WithCancel(context.Background())
	e := &xenv{mem: mem, disk: disk, keys: keys, key: key, srv: srv, addr: lis.Addr().String(), pool: xfer.NewPool(xfer.Config{}), cancel: cancel, done: make(chan error, 1)}
	go func() { e.done <- srv.ServeTransfer(ctx, lis) }()
	t.Cleanup(func() {
		_ = e.pool.Close()
		e.stop(t)
		_ = set.Close()
	})
	return e
}

// stop ends ServeTransfer and checks it returned nil (idempotent).
func (e *xenv) stop(t testing.TB) {
	t.Helper()
	e.cancel()
	select {
	case err, ok := <-e.done:
		if ok && err != nil {
			t.Errorf("ServeTransfer = %v", err)
		}
		if ok {
			close(e.done)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("ServeTransfer did not return")
	}
}

func (e *xenv) reserve(t testing.TB, seg *segment.Segment, size uint64) uint64 {
	t.Helper()
	a, err := seg.Reserve(&masterv1.ReserveItem{SegmentId: seg.ID(), Size: size, Tenant: "t", Key: "k"}, now)
	if err != nil {
		t.Fatal(err)
	}
	return a.GetAllocationId()
}

func (e *xenv) item(seg *segment.Segment, id uint64, mode token.Mode) *agentv1.TransferItem {
	return &agentv1.TransferItem{SegmentId: seg.ID(), AllocationId: id,
		Token: token.Sign(e.key, token.Claims{Mode: mode, Tenant: "t", Key: "k", SegmentID: seg.ID(), AllocationID: id, Expiry: now.Add(time.Minute)})}
}

func seal(t testing.TB, seg *segment.Segment, id uint64, data []byte) {
	t.Helper()
	if err := seg.Seal([]segment.SealArg{{ID: id, Checksum: checksum.Sum(data)}}, now)[0]; err != nil {
		t.Fatalf("Seal(%d): %v", id, err)
	}
}

func TestTransferRoundTrip(t *testing.T) {
	e := startTransfer(t, TransferConfig{})
	ctx := t.Context()
	for _, seg := range []*segment.Segment{e.mem, e.disk} {
		for _, size := range []int{0, 1, 4095, 4096, 64<<10 + 3, 1 << 20, 3<<20 + 5, 8 << 20} {
			t.Run(seg.Medium().String()+"/"+strconv.Itoa(size), func(t *testing.T) {
				data := randBytes(size)
				id := e.reserve(t, seg, uint64(size))
				errs, err := e.pool.Write(ctx, e.addr, []*agentv1.TransferItem{e.item(seg, id, token.Write)}, [][]byte{data})
				if err != nil || errs[0] != nil {
					t.Fatalf("Write = %v, %v", errs, err)
				}
				seal(t, seg, id, data) // the write handle is closed: no "write in progress"
				got := make([]byte, size)
				res, err := e.pool.Read(ctx, e.addr, []*agentv1.TransferItem{e.item(seg, id, token.Read)}, [][]byte{got})
				if err != nil || res[0].Err != nil {
					t.Fatalf("Read = %+v, %v", res, err)
				}
				if !bytes.Equal(got, data) || res[0].N != size || res[0].ObjectSize != uint64(size) || res[0].Checksum != checksum.Sum(data) {
					t.Fatalf("Read = %+v, bytes equal %v; want %d bytes, checksum %#x", res[0], bytes.Equal(got, data), size, checksum.Sum(data))
				}
				if size > 100 {
					it := e.item(seg, id, token.Read)
					it.Offset = 17
					part := make([]byte, 50)
					res, err := e.pool.Read(ctx, e.addr, []*agentv1.TransferItem{it}, [][]byte{part})
					if err != nil || res[0].Err != nil || !bytes.Equal(part, data[17:67]) {
						t.Fatalf("range Read = %+v, %v", res, err)
					}
				}
				if err := seg.Release(id); err != nil {
					t.Fatal(err)
				}
			})
		}
	}
	if got := promtest.ToFloat64(e.srv.bytesIn); got == 0 {
		t.Fatal("bytes_in not counted")
	}
}

// TestTransferWriteAtOffsets writes one object as two ranged items of one
// request.
func TestTransferWriteAtOffsets(t *testing.T) {
	e := startTransfer(t, TransferConfig{})
	data := randBytes(10_000)
	id := e.reserve(t, e.mem, uint64(len(data)))
	a, b := e.item(e.mem, id, token.Write), e.item(e.mem, id, token.Write)
	b.Offset = 6000
	errs, err := e.pool.Write(t.Context(), e.addr, []*agentv1.TransferItem{b, a}, [][]byte{data[6000:], data[:6000]})
	if err != nil || errs[0] != nil || errs[1] != nil {
		t.Fatalf("Write = %v, %v", errs, err)
	}
	seal(t, e.mem, id, data)
}

func TestTransferItemFailuresStayFramed(t *testing.T) {
	e := startTransfer(t, TransferConfig{})
	ctx := t.Context()
	data := [][]byte{randBytes(5000), randBytes(300_000), randBytes(70_000), randBytes(100), randBytes(2 << 20), randBytes(1234)}
	segs := []*segment.Segment{e.mem, e.mem, e.disk, e.mem, e.disk, e.disk}
	items := make([]*agentv1.TransferItem, len(data))
	ids := make([]uint64, len(data))
	for i := range data {
		ids[i] = e.reserve(t, segs[i], uint64(len(data[i])))
		items[i] = e.item(segs[i], ids[i], token.Write)
	}
	// Item 1: a read token; item 3: too long for its allocation (drained).
	items[1] = e.item(e.mem, ids[1], token.Read)
	src := append([][]byte(nil), data...)
	src[3] = randBytes(101)
	errs, err := e.pool.Write(ctx, e.addr, items, src)
	if err != nil {
		t.Fatal(err)
	}
	wantErr(t, errs[1], codes.PermissionDenied, "INVALID_TOKEN")
	wantErr(t, errs[3], codes.OutOfRange, "OUT_OF_BOUNDS")
	for _, i := range []int{0, 2, 4, 5} {
		if errs[i] != nil {
			t.Fatalf("item %d: %v", i, errs[i])
		}
		seal(t, segs[i], ids[i], data[i])
	}
	if got := promtest.ToFloat64(e.srv.errs.WithLabelValues("transfer_write", "OUT_OF_BOUNDS")); got != 1 {
		t.Fatalf("transfer_write OUT_OF_BOUNDS errors = %v, want 1", got)
	}

	// Read them all back in one request: items 1 and 3 are still
	// RESERVED, so they fail in the middle and the others stay framed.
	rItems := make([]*agentv1.TransferItem, len(data))
	dst := make([][]byte, len(data))
	for i := range data {
		rItems[i] = e.item(segs[i], ids[i], token.Read)
		dst[i] = make([]byte, len(data[i]))
	}
	res, err := e.pool.Read(ctx, e.addr, rItems, dst)
	if err != nil {
		t.Fatal(err)
	}
	for i := range data {
		switch i {
		case 1, 3:
			wantErr(t, res[i].Err, codes.FailedPrecondition, "ALLOCATION_STATE")
		default:
			if res[i].Err != nil || !bytes.Equal(dst[i], data[i]) || res[i].Checksum != checksum.Sum(data[i]) {
				t.Fatalf("item %d: %+v, bytes equal %v", i, res[i], bytes.Equal(dst[i], data[i]))
			}
		}
	}
	// The connection is still in step: one more exchange on it works.
	if res, err := e.pool.Read(ctx, e.addr, rItems[:1], dst[:1]); err != nil || res[0].Err != nil {
		t.Fatalf("Read after failures = %+v, %v", res, err)
	}
}

func TestTransferTokensStatesBounds(t *testing.T) {
	e := startTransfer(t, TransferConfig{})
	ctx := t.Context()
	id := e.reserve(t, e.mem, 100)
	w := func(mut func(*agentv1.TransferItem), n int) error {
		it := e.item(e.mem, id, token.Write)
		mut(it)
		errs, err := e.pool.Write(ctx, e.addr, []*agentv1.TransferItem{it}, [][]byte{make([]byte, n)})
		if err != nil {
			t.Fatalf("Write: transport error %v", err)
		}
		return errs[0]
	}
	wantErr(t, w(func(it *agentv1.TransferItem) { it.Token = nil }, 10), codes.PermissionDenied, "INVALID_TOKEN")
	wantErr(t, w(func(it *agentv1.TransferItem) {
		it.Token = token.Sign(e.key, token.Claims{Mode: token.Write, Tenant: "t", Key: "k", SegmentID: e.mem.ID(), AllocationID: id, Expiry: now.Add(-time.Second)})
	}, 10), codes.PermissionDenied, "INVALID_TOKEN")
	wantErr(t, w(func(it *agentv1.TransferItem) { it.Token = e.item(e.mem, id, token.Read).Token }, 10), codes.PermissionDenied, "INVALID_TOKEN")
	wantErr(t, w(func(it *agentv1.TransferItem) { it.AllocationId = id + 1 }, 10), codes.PermissionDenied, "INVALID_TOKEN")
	wantErr(t, w(func(it *agentv1.TransferItem) { it.Offset = 95 }, 10), codes.OutOfRange, "OUT_OF_BOUNDS")
	wantErr(t, w(func(it *agentv1.TransferItem) { it.Offset = ^uint64(0) }, 1), codes.OutOfRange, "OUT_OF_BOUNDS")
	if err := w(func(*agentv1.TransferItem) {}, 100); err != nil {
		t.Fatalf("exact-size write: %v", err)
	}

	// Reads of a RESERVED allocation, past the end, and without a key.
	r := func(it *agentv1.TransferItem, n int) error {
		res, err := e.pool.Read(ctx, e.addr, []*agentv1.TransferItem{it}, [][]byte{make([]byte, n)})
		if err != nil {
			t.Fatalf("Read: transport error %v", err)
		}
		return res[0].Err
	}
	wantErr(t, r(e.item(e.mem, id, token.Read), 100), codes.FailedPrecondition, "ALLOCATION_STATE")
	seal(t, e.mem, id, make([]byte, 100))
	wantErr(t, r(e.item(e.mem, id, token.Write), 100), codes.PermissionDenied, "INVALID_TOKEN")
	wantErr(t, w(func(*agentv1.TransferItem) {}, 100), codes.FailedPrecondition, "ALLOCATION_STATE")
	past := e.item(e.mem, id, token.Read)
	past.Offset = 90
	wantErr(t, r(past, 11), codes.OutOfRange, "OUT_OF_BOUNDS")
	past.Offset = 101
	wantErr(t, r(past, 0), codes.OutOfRange, "OUT_OF_BOUNDS")
	// An empty destination asks for the rest: more than it can hold.
	wantErr(t, r(e.item(e.mem, id, token.Read), 0), codes.InvalidArgument, "INVALID_PARAMS")
	noSeg := e.item(e.mem, id, token.Read)
	noSeg.SegmentId = "nope"
	noSeg.Token = token.Sign(e.key, token.Claims{Mode: token.Read, SegmentID: "nope", AllocationID: id, Expiry: now.Add(time.Minute)})
	wantErr(t, r(noSeg, 1), codes.NotFound, "SEGMENT_NOT_FOUND")
	e.keys.Set(nil)
	wantErr(t, r(e.item(e.mem, id, token.Read), 100), codes.PermissionDenied, "INVALID_TOKEN")
}

// rawConn is a hand-driven client connection.
func rawConn(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return c
}

func frame(t *testing.T, m proto.Message) []byte {
	t.Helper()
	b, err := xfer.AppendFrame(nil, m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// refusal reads the agent's answer to a refused request and checks that the
// connection ends after it.
func refusal(t *testing.T, c net.Conn) error {
	t.Helper()
	resp := &agentv1.TransferResponse{}
	if _, err := xfer.ReadFrame(c, nil, resp); err != nil {
		t.Fatalf("no refusal frame: %v", err)
	}
	if resp.GetError() == nil || len(resp.GetResults()) != 0 {
		t.Fatalf("refusal = %v, want an error and no results", resp)
	}
	if n, err := io.Copy(io.Discard, c); err != nil || n != 0 {
		t.Fatalf("after the refusal: %d more bytes, %v; want EOF", n, err)
	}
	return xfer.ItemError(resp.GetError())
}

func TestTransferMalformed(t *testing.T) {
	e := startTransfer(t, TransferConfig{})
	id := e.reserve(t, e.mem, 100)
	lenPrefix := func(n uint32) []byte { return binary.LittleEndian.AppendUint32(nil, n) }
	manyItems := &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_READ}
	for range xfer.MaxItems + 1 {
		manyItems.Items = append(manyItems.Items, &agentv1.TransferItem{})
	}
	badTok := e.item(e.mem, id, token.Write)
	badTok.Token = []byte("forged")
	badTok.Length = xfer.MaxDrainBytes + 1
	tests := []struct {
		name   string
		wire   []byte
		reason string
	}{
		{"bad preamble", []byte("GET / HTTP/1.1\r\n\r\n"), "INVALID_PARAMS"},
		{"header too large", append([]byte(xfer.Preamble), lenPrefix(xfer.MaxHeaderBytes+1)...), "INVALID_PARAMS"},
		{"header does not decode", append(append([]byte(xfer.Preamble), lenPrefix(3)...), 0xff, 0xff, 0xff), "INVALID_PARAMS"},
		{"empty header", append([]byte(xfer.Preamble), lenPrefix(0)...), "INVALID_PARAMS"},
		{"unknown op", append([]byte(xfer.Preamble), frame(t, &agentv1.TransferRequest{Op: 9, Items: []*agentv1.TransferItem{{}}})...), "INVALID_PARAMS"},
		{"no items", append([]byte(xfer.Preamble), frame(t, &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE})...), "INVALID_PARAMS"},
		{"too many items", append([]byte(xfer.Preamble), frame(t, manyItems)...), "INVALID_PARAMS"},
		{"failed item beyond the drain limit", append(append([]byte(xfer.Preamble), frame(t, &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE, Items: []*agentv1.TransferItem{badTok}})...), make([]byte, 1<<20)...), "INVALID_TOKEN"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := rawConn(t, e.addr)
			if _, err := c.Write(tc.wire); err != nil {
				t.Fatal(err)
			}
			if err := refusal(t, c); rpcerr.Reason(err) != tc.reason {
				t.Fatalf("refused with %v, want reason %s", err, tc.reason)
			}
		})
	}
	// The pool reports a refusal as its call's error, with the reason.
	_, err := e.pool.Write(t.Context(), e.addr, []*agentv1.TransferItem{badTok}, [][]byte{make([]byte, xfer.MaxDrainBytes+1)})
	if rpcerr.Reason(err) != "INVALID_TOKEN" {
		t.Fatalf("Write beyond the drain limit = %v, want the refusal INVALID_TOKEN", err)
	}
	// The listener still serves.
	errs, err := e.pool.Write(t.Context(), e.addr, []*agentv1.TransferItem{e.item(e.mem, id, token.Write)}, [][]byte{make([]byte, 100)})
	if err != nil || errs[0] != nil {
		t.Fatalf("Write after garbage = %v, %v", errs, err)
	}
}

// TestTransferClientGoneMidPayload: a client that dies in the middle of a
// payload leaves no write open (a Seal works) and no pinned read.
func TestTransferClientGoneMidPayload(t *testing.T) {
	e := startTransfer(t, TransferConfig{})
	data := randBytes(4 << 20)
	id := e.reserve(t, e.mem, uint64(len(data)))
	it := e.item(e.mem, id, token.Write)
	it.Length = uint64(len(data))
	c := rawConn(t, e.addr)
	wire := append([]byte(xfer.Preamble), frame(t, &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE, Items: []*agentv1.TransferItem{it}})...)
	if _, err := c.Write(append(wire, data[:1<<20]...)); err != nil {
		t.Fatal(err)
	}
	_ = c.Close()
	testutil.Eventually(t, 10*time.Second, func() bool {
		err := e.mem.Seal([]segment.SealArg{{ID: id, Checksum: checksum.Sum(data)}}, now)[0]
		return rpcerr.Reason(err) == "CHECKSUM_MISMATCH" // not "write in progress"
	}, "the write handle to close")

	// A cancelled pool call returns ctx.Err() and the agent carries on.
	ctx, cancel := context.WithCancel(t.Context())
	time.AfterFunc(time.Millisecond, cancel)
	big := randBytes(32 << 20)
	bid := e.reserve(t, e.mem, uint64(len(big)))
	if _, err := e.pool.Write(ctx, e.addr, []*agentv1.TransferItem{e.item(e.mem, bid, token.Write)}, [][]byte{big}); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled Write = %v, want nil or context.Canceled", err)
	} else if err != nil && err != context.Canceled {
		t.Fatalf("cancelled Write = %v, want ctx.Err() itself", err)
	}
	errs, err := e.pool.Write(t.Context(), e.addr, []*agentv1.TransferItem{e.item(e.mem, bid, token.Write)}, [][]byte{big})
	if err != nil || errs[0] != nil {
		t.Fatalf("Write after a cancelled one = %v, %v", errs, err)
	}
	seal(t, e.mem, bid, big)
}

// plainListener hands out connections that hide their socket
// (syscall.Conn), so the agent reads payloads through its buffered reader.
type plainListener struct{ net.Listener }

type plainConn struct{ net.Conn }

func (l plainListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return plainConn{c}, nil
}

// TestTransferManySmallItems writes thousands of small items in one
// request (more than one readv's worth of buffers, past one deadline step
// of payload, empty ones among them) mixed with disk items and failing
// ones, and reads every byte back, with the socket read directly and
// through the buffered reader.
func TestTransferManySmallItems(t *testing.T) {
	for _, tc := range []struct {
		name string
		wrap func(net.Listener) net.Listener
	}{{"socket", nil}, {"buffered", func(l net.Listener) net.Listener { return plainListener{l} }}} {
		t.Run(tc.name, func(t *testing.T) {
			e := startTransferOn(t, TransferConfig{}, tc.wrap)
			ctx := t.Context()
			r := rand.New(rand.NewPCG(3, 4))
			const n = 3000
			items := make([]*agentv1.TransferItem, n)
			src := make([][]byte, n)
			segs := make([]*segment.Segment, n)
			ids := make([]uint64, n)
			for i := range n {
				size := r.IntN(5000)
				if i%97 == 0 {
					size = 0
				}
				segs[i] = e.mem
				if i%50 == 7 {
					segs[i] = e.disk
				}
				src[i] = randBytes(size)
				ids[i] = e.reserve(t, segs[i], uint64(size))
				items[i] = e.item(segs[i], ids[i], token.Write)
				if i%333 == 5 {
					items[i] = e.item(segs[i], ids[i], token.Read) // refused, drained
				}
			}
			errs, err := e.pool.Write(ctx, e.addr, items, src)
			if err != nil {
				t.Fatal(err)
			}
			for i := range n {
				if i%333 == 5 {
					wantErr(t, errs[i], codes.PermissionDenied, "INVALID_TOKEN")
					continue
				}
				if errs[i] != nil {
					t.Fatalf("item %d: %v", i, errs[i])
				}
				seal(t, segs[i], ids[i], src[i])
				got := make([]byte, len(src[i]))
				res, err := e.pool.Read(ctx, e.addr, []*agentv1.TransferItem{e.item(segs[i], ids[i], token.Read)}, [][]byte{got})
				if err != nil || res[0].Err != nil || !bytes.Equal(got, src[i]) {
					t.Fatalf("item %d read back: %+v, %v, equal %v", i, res, err, bytes.Equal(got, src[i]))
				}
			}
		})
	}
}

func TestTransferShutdown(t *testing.T) {
	e := startTransfer(t, TransferConfig{DrainTimeout: 5 * time.Second})
	ctx := t.Context()
	data := randBytes(1 << 20)
	id := e.reserve(t, e.mem, uint64(len(data)))
	// An idle pooled connection...
	if errs, err := e.pool.Write(ctx, e.addr, []*agentv1.TransferItem{e.item(e.mem, id, token.Write)}, [][]byte{data}); err != nil || errs[0] != nil {
		t.Fatal(errs, err)
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return promtest.ToFloat64(e.srv.xferBusy) == 0 }, "the pooled connection to idle")
	// ... a connection that sent nothing yet, and one in the middle of a
	// request.
	quiet := rawConn(t, e.addr)
	busy := rawConn(t, e.addr)
	it := e.item(e.mem, id, token.Write)
	it.Length = uint64(len(data))
	wire := append([]byte(xfer.Preamble), frame(t, &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE, Items: []*agentv1.TransferItem{it}})...)
	if _, err := busy.Write(append(wire, data[:1000]...)); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return promtest.ToFloat64(e.srv.xferBusy) == 1 }, "the request to start")
	e.cancel()
	// The quiet connection is closed at once; the busy request may finish.
	if n, err := io.Copy(io.Discard, quiet); n != 0 || err != nil {
		t.Fatalf("quiet connection: %d bytes, %v; want EOF", n, err)
	}
	if _, err := busy.Write(data[1000:]); err != nil {
		t.Fatal(err)
	}
	resp := &agentv1.TransferResponse{}
	if _, err := xfer.ReadFrame(busy, nil, resp); err != nil || len(resp.GetResults()) != 1 || xfer.ItemError(resp.GetResults()[0].GetStatus()) != nil {
		t.Fatalf("request finished during the drain: %v, %v", resp, err)
	}
	if n, err := io.Copy(io.Discard, busy); n != 0 || err != nil {
		t.Fatalf("busy connection after its request: %d bytes, %v; want EOF", n, err)
	}
	e.stop(t)
	if c, b := promtest.ToFloat64(e.srv.xferConns), promtest.ToFloat64(e.srv.xferBusy); c != 0 || b != 0 {
		t.Fatalf("after shutdown: %v connections, %v requests in flight; want 0, 0", c, b)
	}
	seal(t, e.mem, id, data)
	// The pool's idle connection is dead now; a new call cannot connect.
	if _, err := e.pool.Write(ctx, e.addr, []*agentv1.TransferItem{e.item(e.mem, id, token.Write)}, [][]byte{data}); rpcerr.Reason(err) != "AGENT_UNAVAILABLE" {
		t.Fatalf("Write after shutdown = %v, want AGENT_UNAVAILABLE", err)
	}
}

func TestTransferShutdownCutsStalledRequests(t *testing.T) {
	e := startTransfer(t, TransferConfig{DrainTimeout: 100 * time.Millisecond})
	id := e.reserve(t, e.mem, 1<<20)
	it := e.item(e.mem, id, token.Write)
	it.Length = 1 << 20
	c := rawConn(t, e.addr)
	if _, err := c.Write(append([]byte(xfer.Preamble), frame(t, &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE, Items: []*agentv1.TransferItem{it}})...)); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return promtest.ToFloat64(e.srv.xferBusy) == 1 }, "the request to start")
	start := time.Now()
	e.stop(t)
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("shutdown took %v with a 100ms drain timeout", d)
	}
	if n, err := io.Copy(io.Discard, c); n != 0 || err != nil {
		t.Fatalf("stalled connection after shutdown: %d bytes, %v; want EOF", n, err)
	}
}

func TestTransferIdleAndStallTimeouts(t *testing.T) {
	e := startTransfer(t, TransferConfig{IdleTimeout: 50 * time.Millisecond, IOTimeout: 50 * time.Millisecond})
	idle := rawConn(t, e.addr)
	if _, err := idle.Write([]byte(xfer.Preamble)); err != nil {
		t.Fatal(err)
	}
	if n, err := io.Copy(io.Discard, idle); n != 0 || err != nil {
		t.Fatalf("idle connection: %d bytes, %v; want EOF", n, err)
	}
	id := e.reserve(t, e.mem, 100)
	it := e.item(e.mem, id, token.Write)
	it.Length = 100
	stalled := rawConn(t, e.addr)
	if _, err := stalled.Write(append(append([]byte(xfer.Preamble), frame(t, &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE, Items: []*agentv1.TransferItem{it}})...), 1, 2, 3)); err != nil {
		t.Fatal(err)
	}
	if n, err := io.Copy(io.Discard, stalled); n != 0 || err != nil {
		t.Fatalf("stalled connection: %d bytes, %v; want EOF", n, err)
	}
	// The stalled write released its handle.
	if err := e.mem.Seal([]segment.SealArg{{ID: id}}, now)[0]; rpcerr.Reason(err) != "CHECKSUM_MISMATCH" {
		t.Fatalf("Seal after the stall = %v, want CHECKSUM_MISMATCH", err)
	}
}

func TestTransferConcurrentClients(t *testing.T) {
	e := startTransfer(t, TransferConfig{})
	ctx := t.Context()
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := range 10 {
				seg := []*segment.Segment{e.mem, e.disk}[(w+i)%2]
				data := randBytes(1000*w + 37*i + 1)
				id := e.reserve(t, seg, uint64(len(data)))
				if errs, err := e.pool.Write(ctx, e.addr, []*agentv1.TransferItem{e.item(seg, id, token.Write)}, [][]byte{data}); err != nil || errs[0] != nil {
					t.Errorf("Write = %v, %v", errs, err)
					return
				}
				seal(t, seg, id, data)
				got := make([]byte, len(data))
				if res, err := e.pool.Read(ctx, e.addr, []*agentv1.TransferItem{e.item(seg, id, token.Read)}, [][]byte{got}); err != nil || res[0].Err != nil || !bytes.Equal(got, data) {
					t.Errorf("Read = %+v, %v", res, err)
					return
				}
				_ = seg.Release(id)
			}
		})
	}
	wg.Wait()
}

// FuzzTransferConn feeds arbitrary bytes to a connection handler as its
// client: it must neither panic nor hang nor leak a goroutine or a handle.
func FuzzTransferConn(f *testing.F) {
	mem, err := segment.NewMemory("fuzz", 1<<20)
	if err != nil {
		f.Fatal(err)
	}
	defer mem.Close()
	key := token.SigningKey{ID: 1, Secret: make([]byte, token.KeyLen)}
	keys := &Keyring{}
	keys.Set(tokenKeys(key))
	srv := New(Config{Transfer: TransferConfig{IOTimeout: time.Second, IdleTimeout: time.Second}},
		Deps{Segments: segment.NewSet(mem), Keys: keys, Now: func() time.Time { return now }}, testutil.Logger())
	wid, err := mem.Reserve(&masterv1.ReserveItem{SegmentId: mem.ID(), Size: 64, Key: "k"}, now)
	if err != nil {
		f.Fatal(err)
	}
	rid, err := mem.Reserve(&masterv1.ReserveItem{SegmentId: mem.ID(), Size: 64, Key: "k"}, now)
	if err != nil {
		f.Fatal(err)
	}
	mem.Seal([]segment.SealArg{{ID: rid.GetAllocationId(), Checksum: checksum.Sum(make([]byte, 64))}}, now)
	tok := func(mode token.Mode, id uint64) []byte {
		return token.Sign(key, token.Claims{Mode: mode, Key: "k", SegmentID: mem.ID(), AllocationID: id, Expiry: now.Add(time.Hour)})
	}
	req := func(op agentv1.TransferOp, items ...*agentv1.TransferItem) []byte {
		b, _ := xfer.AppendFrame([]byte(xfer.Preamble), &agentv1.TransferRequest{Op: op, Items: items})
		return b
	}
	w := &agentv1.TransferItem{SegmentId: mem.ID(), AllocationId: wid.GetAllocationId(), Token: tok(token.Write, wid.GetAllocationId()), Length: 10}
	r := &agentv1.TransferItem{SegmentId: mem.ID(), AllocationId: rid.GetAllocationId(), Token: tok(token.Read, rid.GetAllocationId())}
	f.Add(append(req(agentv1.TransferOp_TRANSFER_OP_WRITE, w, &agentv1.TransferItem{Length: 3}), make([]byte, 13)...))
	f.Add(append(req(agentv1.TransferOp_TRANSFER_OP_READ, r, w), req(agentv1.TransferOp_TRANSFER_OP_READ, r)[len(xfer.Preamble):]...))
	f.Add(req(agentv1.TransferOp_TRANSFER_OP_WRITE, w))
	f.Add(append(req(agentv1.TransferOp_TRANSFER_OP_VERIFY, r, w), req(agentv1.TransferOp_TRANSFER_OP_READ, r)[len(xfer.Preamble):]...))
	f.Add([]byte(xfer.Preamble + "\xff\xff\xff\xff"))
	f.Add([]byte("CXF0"))
	f.Fuzz(func(t *testing.T, in []byte) {
		ts := newTransferServer(srv)
		client, server := net.Pipe()
		c, err := ts.add(server)
		if err != nil {
			t.Fatal(err)
		}
		served := make(chan struct{})
		go func() {
			defer close(served)
			ts.serve(c)
		}()
		go func() { _, _ = io.Copy(io.Discard, client) }()
		_ = client.SetWriteDeadline(time.Now().Add(2 * time.Second))
		_, _ = client.Write(in)
		_ = client.Close()
		select {
		case <-served:
		case <-time.After(5 * time.Second):
			t.Fatal("connection handler did not return after the client left")
		}
		if ts.conns.Len() != 0 {
			t.Fatal("connection not removed")
		}
	})
	// No handle may stay open: sealing the written allocation must not
	// find a write in progress.
	if err := mem.Seal([]segment.SealArg{{ID: wid.GetAllocationId()}}, now)[0]; rpcerr.Reason(err) == "ALLOCATION_STATE" {
		f.Fatalf("a write handle leaked: %v", err)
	}
}
