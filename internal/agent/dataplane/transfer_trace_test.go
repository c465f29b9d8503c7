package dataplane

import (
	"strings"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/tracectx"
	"github.com/crescent-kv/crescent/internal/tracectx/tracectxtest"
	"github.com/crescent-kv/crescent/internal/xfer"
	"go.opentelemetry.io/otel/trace"
)

var testTracer = tracectx.NewTracer("github.com/crescent-kv/crescent/internal/agent/dataplane_test")

// TestTransferSpans: a traced client's transfer.write and transfer.read
// spans are children of its caller's span, and the agent's spans of the
// same names are children of the client's, across the request header, with
// the items' outcome.
func TestTransferSpans(t *testing.T) {
	rec := tracectxtest.Install(t)
	e := startTransfer(t, TransferConfig{})
	data := randBytes(5000)
	id := e.reserve(t, e.mem, uint64(len(data)))
	bad := e.item(e.mem, id, token.Write)
	bad.Token = []byte("forged")

	ctx, caller := testTracer.Start(t.Context(), "client.put")
	errs, err := e.pool.Write(ctx, e.addr, []*agentv1.TransferItem{e.item(e.mem, id, token.Write), bad}, [][]byte{data, {1, 2}})
	if err != nil || errs[0] != nil || errs[1] == nil {
		t.Fatalf("Write = %v, %v", errs, err)
	}
	seal(t, e.mem, id, data)
	got := make([]byte, len(data))
	if res, err := e.pool.Read(ctx, e.addr, []*agentv1.TransferItem{e.item(e.mem, id, token.Read)}, [][]byte{got}); err != nil || res[0].Err != nil {
		t.Fatalf("Read = %v, %v", res, err)
	}
	caller.End()
	// The agent ends its span once the answer is written: maybe after the
	// client went on.
	testutil.Eventually(t, 10*time.Second, func() bool {
		return len(tracectxtest.Named(rec, "transfer.write")) == 2 && len(tracectxtest.Named(rec, "transfer.read")) == 2
	}, "the client's and the agent's spans")

	for _, tc := range []struct {
		name          string
		items, failed string
		bytes         string
	}{
		{"transfer.write", "2", "1", "5000"},
		{"transfer.read", "1", "", "5000"},
	} {
		var client, agentParent trace.SpanContext
		spans := tracectxtest.Named(rec, tc.name)
		if len(spans) != 2 {
			t.Fatalf("%d %s spans, want the client's and the agent's", len(spans), tc.name)
		}
		for _, s := range spans {
			switch s.SpanKind() {
			case trace.SpanKindClient:
				tracectxtest.ChildOf(t, s, caller.SpanContext())
				client = s.SpanContext()
			case trace.SpanKindServer:
				agentParent = s.Parent()
				if got := tracectxtest.Attr(s, string(tracectx.Items)); got != tc.items {
					t.Errorf("agent %s: items %q, want %s", tc.name, got, tc.items)
				}
				if got := tracectxtest.Attr(s, string(tracectx.Failed)); got != tc.failed {
					t.Errorf("agent %s: failed %q, want %q", tc.name, got, tc.failed)
				}
				if got := tracectxtest.Attr(s, string(tracectx.Bytes)); got != tc.bytes {
					t.Errorf("agent %s: bytes %q, want %s", tc.name, got, tc.bytes)
				}
				if got := tracectxtest.Attr(s, string(tracectx.Segment)); got != e.mem.ID() {
					t.Errorf("agent %s: segment %q", tc.name, got)
				}
			}
		}
		if !client.IsValid() || !agentParent.Equal(client.WithRemote(true)) {
			t.Fatalf("agent %s: parent %v, want the client's span %v", tc.name, agentParent, client)
		}
	}
}

// TestTransferUntracedAndHostileTraceContext: an untraced client makes no
// span and sends no trace bytes; a header whose trace context is garbage
// or oversized is served, untraced.
func TestTransferUntracedAndHostileTraceContext(t *testing.T) {
	rec := tracectxtest.Install(t)
	e := startTransfer(t, TransferConfig{})
	e.roundTrip(t)
	if n := len(rec.Ended()); n != 0 {
		t.Fatalf("%d spans for an untraced client", n)
	}
	plain := frame(t, &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_READ, Items: []*agentv1.TransferItem{{SegmentId: "s"}}})
	if traced := frame(t, &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_READ, Items: []*agentv1.TransferItem{{SegmentId: "s"}}, TraceContext: tracectx.Transfer(t.Context())}); len(traced) != len(plain) {
		t.Fatalf("an untraced header is %d bytes, %d without the field", len(traced), len(plain))
	}

	data := randBytes(100)
	id := e.reserve(t, e.mem, uint64(len(data)))
	for i, tc := range []*agentv1.TraceContext{
		{Traceparent: "garbage", Tracestate: "=="},
		{Traceparent: strings.Repeat("0", tracectx.MaxTraceparent+1)},
		{Traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", Tracestate: strings.Repeat("a", xfer.MaxHeaderBytes/4)},
		{Tracestate: "only=state"},
	} {
		c := rawConn(t, e.addr)
		it := e.item(e.mem, id, token.Write)
		it.Length = uint64(len(data))
		wire := append([]byte(xfer.Preamble), frame(t, &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE, Items: []*agentv1.TransferItem{it}, TraceContext: tc})...)
		if _, err := c.Write(append(wire, data...)); err != nil {
			t.Fatal(err)
		}
		resp := &agentv1.TransferResponse{}
		if _, err := xfer.ReadFrame(c, nil, resp); err != nil || resp.GetError() != nil || len(resp.GetResults()) != 1 || resp.GetResults()[0].GetStatus().GetCode() != 0 {
			t.Fatalf("context %d: response %v, %v", i, resp, err)
		}
	}
	// The third carried a valid, sampled parent with an oversized trace
	// state: traced, without the state. (The agent ends its span once the
	// answer is written: maybe after the client read it.)
	testutil.Eventually(t, 10*time.Second, func() bool { return len(tracectxtest.Named(rec, "transfer.write")) > 0 }, "the agent's span")
	spans := tracectxtest.Named(rec, "transfer.write")
	if len(spans) != 1 || spans[0].SpanContext().TraceState().Len() != 0 {
		t.Fatalf("%d spans for the hostile headers, want the one with a valid parent (and no trace state)", len(spans))
	}
}
