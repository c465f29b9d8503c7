package dataplane

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math"
	"net"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
)

// The hostile-input tests of issue 11, item 6: raw TCP connections to a
// real transfer listener on loopback send crafted headers; each ends with
// an error frame (or a closed connection), the listener keeps serving, and
// what the agent holds stays bounded.

// dialFrom opens a raw connection to addr from the loopback address src
// (127.0.0.0/8 is all local on Linux), so tests can play several peers.
func dialFrom(t *testing.T, src, addr string) net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	return c
}

// tinyItemsHeader is a frame whose header is n empty items (2 bytes each),
// declared with its true length.
func tinyItemsHeader(n int) []byte {
	b := binary.LittleEndian.AppendUint32(nil, uint32(2*n))
	for range n {
		b = protowire.AppendTag(b, 2 /* TransferRequest.items */, protowire.BytesType)
		b = protowire.AppendVarint(b, 0)
	}
	return b
}

// roundTrip writes and reads back one object through the pool: the
// listener still serves a normal client.
func (e *xenv) roundTrip(t *testing.T) {
	t.Helper()
	data := randBytes(10_000)
	id := e.reserve(t, e.mem, uint64(len(data)))
	if errs, err := e.pool.Write(t.Context(), e.addr, []*agentv1.TransferItem{e.item(e.mem, id, token.Write)}, [][]byte{data}); err != nil || errs[0] != nil {
		t.Fatalf("normal Write = %v, %v", errs, err)
	}
	seal(t, e.mem, id, data)
	got := make([]byte, len(data))
	if res, err := e.pool.Read(t.Context(), e.addr, []*agentv1.TransferItem{e.item(e.mem, id, token.Read)}, [][]byte{got}); err != nil || res[0].Err != nil || !bytes.Equal(got, data) {
		t.Fatalf("normal Read = %+v, %v", res, err)
	}
	if err := e.mem.Release(id); err != nil {
		t.Fatal(err)
	}
}

func wantRefusal(t *testing.T, c net.Conn, code codes.Code, reason string) {
	t.Helper()
	err := refusal(t, c)
	if rpcerr.Reason(err) != reason || status.Code(rpcerr.Status(err)) != code {
		t.Fatalf("refused with %v, want %s %s", err, code, reason)
	}
}

func TestTransferHostileHeaders(t *testing.T) {
	e := startTransfer(t, TransferConfig{IOTimeout: 2 * time.Second})
	id := e.reserve(t, e.mem, 100)
	pre := []byte(xfer.Preamble)
	req := func(op agentv1.TransferOp, items ...*agentv1.TransferItem) []byte {
		return append(append([]byte(nil), pre...), frame(t, &agentv1.TransferRequest{Op: op, Items: items})...)
	}
	withLen := func(n uint64) *agentv1.TransferItem {
		it := e.item(e.mem, id, token.Write)
		it.Length = n
		return it
	}
	tests := []struct {
		name   string
		wire   []byte
		reason string
	}{
		{"declared header of 4 GiB", append(append([]byte(nil), pre...), 0xff, 0xff, 0xff, 0xff), "INVALID_PARAMS"},
		{"a megabyte of tiny items", append(append([]byte(nil), pre...), tinyItemsHeader(xfer.MaxHeaderBytes/2)...), "INVALID_PARAMS"},
		{"one item too many", append(append([]byte(nil), pre...), tinyItemsHeader(xfer.MaxItems+1)...), "INVALID_PARAMS"},
		{"item of 2^64-1 bytes", req(agentv1.TransferOp_TRANSFER_OP_WRITE, withLen(math.MaxUint64)), "INVALID_PARAMS"},
		{"lengths that wrap to 4", req(agentv1.TransferOp_TRANSFER_OP_WRITE, withLen(math.MaxUint64), withLen(5)), "INVALID_PARAMS"},
		{"payload of 2^63 bytes", req(agentv1.TransferOp_TRANSFER_OP_READ, withLen(1<<62), withLen(1<<62)), "INVALID_PARAMS"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := rawConn(t, e.addr)
			if _, err := c.Write(tc.wire); err != nil {
				t.Fatal(err)
			}
			wantRefusal(t, c, codes.InvalidArgument, tc.reason)
			e.roundTrip(t)
		})
	}

	// offset+length past 2^64 on a real allocation: an item error, and
	// the connection stays in step.
	rid := e.reserve(t, e.mem, 100)
	if errs, err := e.pool.Write(t.Context(), e.addr, []*agentv1.TransferItem{e.item(e.mem, rid, token.Write)}, [][]byte{make([]byte, 100)}); err != nil || errs[0] != nil {
		t.Fatalf("Write = %v, %v", errs, err)
	}
	seal(t, e.mem, rid, make([]byte, 100))
	r := e.item(e.mem, rid, token.Read)
	r.Offset, r.Length = math.MaxUint64-10, 100 // offset+length wraps to 89
	r2 := e.item(e.mem, rid, token.Read)
	r2.Offset, r2.Length = 50, math.MaxInt64-100
	c := rawConn(t, e.addr)
	if _, err := c.Write(req(agentv1.TransferOp_TRANSFER_OP_READ, r, r2)); err != nil {
		t.Fatal(err)
	}
	resp := &agentv1.TransferResponse{}
	if _, err := xfer.ReadFrame(c, nil, resp); err != nil || len(resp.GetResults()) != 2 {
		t.Fatalf("answer = %v, %v", resp, err)
	}
	for i, res := range resp.GetResults() {
		wantErr(t, xfer.ItemError(res.GetStatus()), codes.OutOfRange, "OUT_OF_BOUNDS")
		if res.GetLength() != 0 {
			t.Fatalf("item %d promises %d payload bytes", i, res.GetLength())
		}
	}
	w := e.item(e.mem, id, token.Write)
	w.Offset, w.Length = math.MaxUint64-50, 100
	if _, err := c.Write(frame(t, &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE, Items: []*agentv1.TransferItem{w}})); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write(make([]byte, 100)); err != nil {
		t.Fatal(err)
	}
	if _, err := xfer.ReadFrame(c, nil, resp); err != nil || len(resp.GetResults()) != 1 {
		t.Fatalf("answer = %v, %v", resp, err)
	}
	wantErr(t, xfer.ItemError(resp.GetResults()[0].GetStatus()), codes.OutOfRange, "OUT_OF_BOUNDS")
	e.roundTrip(t)

	// A header over the agent's own limit: LIMIT_EXCEEDED before it is
	// read.
	small := startTransfer(t, TransferConfig{MaxHeaderBytes: 4 << 10})
	c = rawConn(t, small.addr)
	if _, err := c.Write(append(append([]byte(nil), pre...), tinyItemsHeader(3000)...)); err != nil {
		t.Fatal(err)
	}
	wantRefusal(t, c, codes.ResourceExhausted, "LIMIT_EXCEEDED")
	small.roundTrip(t)
}

// heapInUse is HeapInuse after a collection.
func heapInUse() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapInuse
}

func totalAlloc() uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.TotalAlloc
}

// TestTransferHostileMemory replays the attack: 40 connections
// sending a megabyte of crafted header each (40 MiB) took an agent from 31
// to 443 MB. Now what the agent allocates for them, and what it holds for
// connections that announce a megabyte and stall, stay far below the
// volume sent.
func TestTransferHostileMemory(t *testing.T) {
	e := startTransfer(t, TransferConfig{IOTimeout: 3 * time.Second})
	const conns = 40
	wire := append([]byte(xfer.Preamble), tinyItemsHeader(xfer.MaxHeaderBytes/2)...)
	volume := uint64(conns * len(wire))
	cs := make([]net.Conn, conns)
	for i := range cs {
		cs[i] = rawConn(t, e.addr)
	}
	before := totalAlloc()
	var wg sync.WaitGroup
	for _, c := range cs {
		wg.Go(func() {
			// The agent refuses early; the rest of the write may fail.
			_, _ = c.Write(wire)
		})
	}
	for _, c := range cs {
		wantRefusal(t, c, codes.InvalidArgument, "INVALID_PARAMS")
	}
	wg.Wait()
	got := totalAlloc() - before
	t.Logf("the agent allocated %d KiB for %d KiB of hostile headers", got>>10, volume>>10)
	if got > volume/4 {
		t.Fatalf("the agent allocated %d bytes for %d bytes of hostile headers; want at most a quarter", got, volume)
	}
	e.roundTrip(t)

	// Connections that announce a megabyte of header and stall.
	testutil.Eventually(t, 10*time.Second, func() bool { return promtest.ToFloat64(e.srv.xferConns) <= 1 }, "the refused connections to go")
	base := heapInUse()
	for i := range cs {
		cs[i] = rawConn(t, e.addr)
		if _, err := cs[i].Write(append([]byte(xfer.Preamble), 0, 0, 0x10, 0, 0x12)); err != nil {
			t.Fatal(err)
		}
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return promtest.ToFloat64(e.srv.xferBusy) == conns }, "the stalled requests to start")
	held := int64(heapInUse()) - int64(base)
	t.Logf("%d stalled headers of a declared megabyte hold %d KiB", conns, held>>10)
	if held > int64(volume/4) {
		t.Fatalf("%d stalled headers of a declared megabyte hold %d bytes; want at most %d", conns, held, volume/4)
	}
	// IOTimeout cuts them.
	for _, c := range cs {
		if n, err := io.Copy(io.Discard, c); n != 0 || err != nil {
			t.Fatalf("stalled connection: %d bytes, %v; want EOF", n, err)
		}
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return promtest.ToFloat64(e.srv.xferConns) <= 1 }, "the stalled connections to go")
	e.roundTrip(t)
}

// TestTransferSlowLoris: a peer that trickles its header, or its payload,
// is cut after IOTimeout although bytes keep coming, and its allocation
// is released.
func TestTransferSlowLoris(t *testing.T) {
	e := startTransfer(t, TransferConfig{IOTimeout: 300 * time.Millisecond})
	id := e.reserve(t, e.mem, 1<<20)
	it := e.item(e.mem, id, token.Write)
	it.Length = 1 << 20
	wire := append([]byte(xfer.Preamble), frame(t, &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE, Items: []*agentv1.TransferItem{it}})...)
	for _, tc := range []struct {
		name          string
		sent, trickle []byte
	}{
		{"header", wire[:len(xfer.Preamble)+2], wire[len(xfer.Preamble)+2:]},
		{"payload", wire, make([]byte, 1<<20)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := rawConn(t, e.addr)
			if _, err := c.Write(tc.sent); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			cut := make(chan error, 1)
			go func() {
				_, err := io.Copy(io.Discard, c)
				cut <- err
			}()
			tick := time.NewTicker(20 * time.Millisecond)
			defer tick.Stop()
			for rest := tc.trickle; ; {
				select {
				case err := <-cut:
					// A byte that arrived as the agent closed turns
					// its FIN into a reset.
					if err != nil && !errors.Is(err, syscall.ECONNRESET) {
						t.Fatalf("cut with %v, want EOF or a reset", err)
					}
					if d := time.Since(start); d > 5*time.Second {
						t.Fatalf("cut after %v with a 300ms IOTimeout", d)
					}
					testutil.Eventually(t, 10*time.Second, func() bool {
						err := e.mem.Seal([]segment.SealArg{{ID: id}}, now)[0]
						return rpcerr.Reason(err) == "CHECKSUM_MISMATCH" // not "write in progress"
					}, "the write handle to close")
					e.roundTrip(t)
					return
				case <-tick.C:
					if len(rest) == 0 {
						t.Fatal("the whole request trickled in without a cut")
					}
					_, _ = c.Write(rest[:1]) // fails once the agent cut it: the reader reports
					rest = rest[1:]
				case <-t.Context().Done():
					return
				}
			}
		})
	}
}

// TestTransferConnectionLimits: one peer cannot hold more than
// MaxConnsPerIP connections nor all of them more than MaxConns; one more is
// answered RESOURCE_EXHAUSTED LIMIT_EXCEEDED and closed, counted, and the
// others keep being served.
func TestTransferConnectionLimits(t *testing.T) {
	e := startTransfer(t, TransferConfig{MaxConns: 8, MaxConnsPerIP: 4})
	e.roundTrip(t) // the pool keeps one connection from 127.0.0.1
	idle := func(src string, n int) []net.Conn {
		cs := make([]net.Conn, n)
		for i := range cs {
			cs[i] = dialFrom(t, src, e.addr)
			if _, err := cs[i].Write([]byte(xfer.Preamble)); err != nil {
				t.Fatal(err)
			}
		}
		return cs
	}
	conns := func() float64 { return promtest.ToFloat64(e.srv.xferConns) }
	refused := func(limit string) float64 { return promtest.ToFloat64(e.srv.xferRefused.WithLabelValues(limit)) }

	peer := idle("127.0.0.2", 4)
	testutil.Eventually(t, 10*time.Second, func() bool { return conns() == 5 }, "the peer's connections")
	extra := dialFrom(t, "127.0.0.2", e.addr)
	// A client sends its preamble and first request, then reads the
	// refusal in place of the answer.
	if _, err := extra.Write(append([]byte(xfer.Preamble), tinyItemsHeader(1)...)); err != nil {
		t.Fatal(err)
	}
	wantRefusal(t, extra, codes.ResourceExhausted, "LIMIT_EXCEEDED")
	if got := refused("max_connections_per_ip"); got != 1 {
		t.Fatalf("refused per IP = %v, want 1", got)
	}
	e.roundTrip(t)

	others := idle("127.0.0.3", 3)
	testutil.Eventually(t, 10*time.Second, func() bool { return conns() == 8 }, "the other peer's connections")
	full := dialFrom(t, "127.0.0.4", e.addr)
	wantRefusal(t, full, codes.ResourceExhausted, "LIMIT_EXCEEDED")
	if got := refused("max_connections"); got != 1 {
		t.Fatalf("refused in total = %v, want 1", got)
	}
	if got := conns(); got != 8 {
		t.Fatalf("%v open connections, want the cap of 8", got)
	}
	// The pool's kept connection still serves.
	e.roundTrip(t)

	// The pool reports a refused connection as its call's error.
	_ = e.pool.Close()
	testutil.Eventually(t, 10*time.Second, func() bool { return conns() == 7 }, "the pool's connection to go")
	last := idle("127.0.0.5", 1)
	testutil.Eventually(t, 10*time.Second, func() bool { return conns() == 8 }, "the last place to be taken")
	e.pool = xfer.NewPool(xfer.Config{})
	_, err := e.pool.Write(t.Context(), e.addr, []*agentv1.TransferItem{e.item(e.mem, 1, token.Write)}, [][]byte{{1}})
	if rpcerr.Reason(err) != "LIMIT_EXCEEDED" || status.Code(rpcerr.Status(err)) != codes.ResourceExhausted {
		t.Fatalf("Write on a full agent = %v, want RESOURCE_EXHAUSTED LIMIT_EXCEEDED", err)
	}

	// Closing them frees their places.
	for _, c := range append(append(peer, others...), last...) {
		_ = c.Close()
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return conns() == 0 }, "the closed connections to go")
	e.roundTrip(t)
	for range 3 {
		c := dialFrom(t, "127.0.0.2", e.addr)
		_ = c.Close()
	}
	e.roundTrip(t)
	if got := refused("max_connections_per_ip") + refused("max_connections"); got != 3 {
		t.Fatalf("refused = %v, want 3 (the later connections were accepted)", got)
	}
}

// TestTransferItemsInFlight: requests of thousands of tiny items hold
// memory out of proportion to their headers; MaxItemsInFlight bounds them
// over all connections. A request past it waits for items to be given
// back, then is refused with RESOURCE_EXHAUSTED LIMIT_EXCEEDED; waiting
// requests hold no decoded items.
func TestTransferItemsInFlight(t *testing.T) {
	e := startTransfer(t, TransferConfig{MaxItemsInFlight: xfer.MaxItems, IOTimeout: time.Second})
	items := func() float64 { return promtest.ToFloat64(e.srv.xferItems) }
	// A holds the whole budget: 4096 failing items, the first draining
	// 256 MiB that A sends 4 MiB at a time, fast enough to stay alive.
	big := &agentv1.TransferItem{SegmentId: e.mem.ID(), AllocationId: 1, Length: xfer.MaxDrainBytes}
	req := &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE, Items: []*agentv1.TransferItem{big}}
	for range xfer.MaxItems - 1 {
		req.Items = append(req.Items, &agentv1.TransferItem{})
	}
	a := rawConn(t, e.addr)
	if _, err := a.Write(append([]byte(xfer.Preamble), frame(t, req)...)); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	sent := make(chan struct{})
	go func() {
		defer close(sent)
		chunk := make([]byte, 4<<20)
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				if _, err := a.Write(chunk); err != nil {
					return
				}
			}
		}
	}()
	testutil.Eventually(t, 10*time.Second, func() bool { return items() == xfer.MaxItems }, "A to hold the budget")

	// Waiting requests hold their header, not decoded items.
	const waiting = 20
	base := heapInUse()
	ws := make([]net.Conn, waiting)
	// Each waits IOTimeout from its arrival, so at least that long after
	// this; timing from after the checks below would count against the
	// wait whatever they took on a loaded machine.
	sentAt := time.Now()
	for i := range ws {
		ws[i] = rawConn(t, e.addr)
		if _, err := ws[i].Write(append([]byte(xfer.Preamble), frame(t, req)...)); err != nil {
			t.Fatal(err)
		}
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return promtest.ToFloat64(e.srv.xferBusy) == waiting+1 }, "the others to wait")
	held := int64(heapInUse()) - int64(base)
	t.Logf("%d requests of %d items waiting for the budget hold %d KiB", waiting, xfer.MaxItems, held>>10)
	if held > waiting*xfer.MaxItems*250/4 {
		t.Fatalf("%d waiting requests hold %d bytes; want far less than their decoded items", waiting, held)
	}
	for _, c := range ws {
		wantRefusal(t, c, codes.ResourceExhausted, "LIMIT_EXCEEDED")
	}
	if d := time.Since(sentAt); d < 900*time.Millisecond {
		t.Fatalf("refused %v after the requests were sent; want a wait of IOTimeout (1s) first", d)
	}
	if got := items(); got != xfer.MaxItems {
		t.Fatalf("%v items in flight, want A's %d", got, xfer.MaxItems)
	}

	// A normal client waits for A to go, then is served.
	gone := make(chan struct{})
	time.AfterFunc(100*time.Millisecond, func() {
		defer close(gone)
		close(stop)
		<-sent
		_ = a.Close()
	})
	e.roundTrip(t)
	<-gone
	testutil.Eventually(t, 10*time.Second, func() bool { return items() == 0 }, "the budget to be given back")
}

// TestTransferIdleConnectionsTrim: connections that served a request of a
// thousand items and then idle give back the arrays they keep for the
// next one, after idleTrim.
func TestTransferIdleConnectionsTrim(t *testing.T) {
	e := startTransfer(t, TransferConfig{})
	const conns, n = 40, 1000
	req := &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE}
	for range n {
		req.Items = append(req.Items, &agentv1.TransferItem{}) // no token: each fails, no payload
	}
	wire := append([]byte(xfer.Preamble), frame(t, req)...)
	base := heapInUse()
	for range conns {
		c := rawConn(t, e.addr)
		if _, err := c.Write(wire); err != nil {
			t.Fatal(err)
		}
		resp := &agentv1.TransferResponse{}
		if _, err := xfer.ReadFrame(c, nil, resp); err != nil || len(resp.GetResults()) != n {
			t.Fatalf("answer: %d results, %v", len(resp.GetResults()), err)
		}
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return promtest.ToFloat64(e.srv.xferBusy) == 0 }, "the requests to end")
	kept := int64(heapInUse()) - int64(base)
	time.Sleep(idleTrim + 500*time.Millisecond)
	trimmed := int64(heapInUse()) - int64(base)
	t.Logf("%d idle connections after a %d-item request: %d KiB kept, %d KiB after %v", conns, n, kept>>10, trimmed>>10, idleTrim)
	if trimmed > kept/2 || trimmed > conns*2*transferReadBuffer {
		t.Fatalf("idle connections hold %d bytes after the trim (%d before); want about their read buffers", trimmed, kept)
	}
	e.roundTrip(t)
}

// TestTransferRefusalFlood: a flood of connections past MaxConns costs
// the agent at most maxRejecting goroutines answering refusals; the rest
// are closed at once.
func TestTransferRefusalFlood(t *testing.T) {
	e := startTransfer(t, TransferConfig{MaxConns: 1})
	holder := rawConn(t, e.addr)
	if _, err := holder.Write([]byte(xfer.Preamble)); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() bool { return promtest.ToFloat64(e.srv.xferConns) == 1 }, "the holder's connection")
	base := runtime.NumGoroutine()
	const flood = 200
	cs := make([]net.Conn, flood)
	for i := range cs {
		cs[i] = rawConn(t, e.addr) // sends nothing, reads nothing: each answer lingers
	}
	testutil.Eventually(t, 10*time.Second, func() bool {
		return promtest.ToFloat64(e.srv.xferRefused.WithLabelValues("max_connections")) == flood
	}, "the flood to be refused")
	if extra := runtime.NumGoroutine() - base; extra > maxRejecting+5 {
		t.Fatalf("%d more goroutines for %d refused connections; want at most %d answering", extra, flood, maxRejecting)
	}
	// Every one of them ends, answered or not.
	answered := 0
	for _, c := range cs {
		resp := &agentv1.TransferResponse{}
		if _, err := xfer.ReadFrame(c, nil, resp); err == nil {
			answered++
			wantErr(t, xfer.ItemError(resp.GetError()), codes.ResourceExhausted, "LIMIT_EXCEEDED")
		}
		_, _ = io.Copy(io.Discard, c)
		_ = c.Close()
	}
	t.Logf("%d of %d refused connections answered", answered, flood)
	if answered == 0 || answered > flood {
		t.Fatalf("%d refused connections answered", answered)
	}
	_ = holder.Close()
	testutil.Eventually(t, 10*time.Second, func() bool { return promtest.ToFloat64(e.srv.xferConns) == 0 }, "the holder to go")
	e.roundTrip(t)
}
