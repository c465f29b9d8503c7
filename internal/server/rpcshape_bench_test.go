package server

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// BenchmarkRPCShape weighs the two shapes issue 18 item 1 allows for the
// SDK's coalesced calls: a unary call per batch, or the batches
// multiplexed over one long-lived bidirectional stream, answered by
// request id (one goroutine sends on the stream, one receives, on both
// sides). Messages are opaque bytes the size of a 28-item lookup (2 KiB
// out, 6 KiB back), on grpc-go with no interceptors, from 1, 2 and 3
// callers in flight: what a batch's RPC costs in CPU (client and server,
// per call) and in round-trip time, with nothing else in the way.
//
//	go test ./internal/server -run '^$' -bench RPCShape -benchtime 20000x
func BenchmarkRPCShape(b *testing.B) {
	const reqSize, respSize = 2 << 10, 6 << 10
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	// The transport settings of this package's servers and of the SDK's
	// connections (static flow-control windows), without their
	// interceptors.
	gs := grpc.NewServer(grpc.ForceServerCodec(shapeCodec{}), grpc.InitialWindowSize(streamWindow), grpc.InitialConnWindowSize(connWindow))
	gs.RegisterService(&shapeDesc, make([]byte, respSize))
	var serving sync.WaitGroup
	serving.Go(func() { _ = gs.Serve(lis) })
	defer func() { gs.Stop(); serving.Wait() }()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(shapeCodec{})),
		grpc.WithInitialWindowSize(16<<20), grpc.WithInitialConnWindowSize(64<<20), grpc.WithReadBufferSize(1<<20))
	if err != nil {
		b.Fatal(err)
	}
	defer cc.Close()
	measure := func(b *testing.B, inflight int, call func() error) {
		cpu0, start := testutil.ProcessCPU(), time.Now()
		var wg sync.WaitGroup
		for range inflight {
			wg.Go(func() {
				for range b.N {
					if err := call(); err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
		b.ReportMetric(float64(time.Since(start).Microseconds())/float64(b.N), "µs/rtt")
		b.ReportMetric(float64((testutil.ProcessCPU()-cpu0).Microseconds())/float64(b.N*inflight), "cpu-µs/call")
	}
	for _, inflight := range []int{1, 2, 3} {
		b.Run(fmt.Sprintf("unary-%d", inflight), func(b *testing.B) {
			req := make([]byte, reqSize)
			measure(b, inflight, func() error {
				var out []byte
				return cc.Invoke(b.Context(), "/bench.Shape/Unary", &req, &out)
			})
		})
		b.Run(fmt.Sprintf("stream-%d", inflight), func(b *testing.B) {
			m, err := newShapeMux(b.Context(), cc)
			if err != nil {
				b.Fatal(err)
			}
			defer m.close()
			measure(b, inflight, func() error { return m.call(make([]byte, reqSize)) })
		})
	}
}

// shapeCodec passes []byte messages through.
type shapeCodec struct{}

func (shapeCodec) Name() string                  { return "bench-bytes" }
func (shapeCodec) Marshal(v any) ([]byte, error) { return *(v.(*[]byte)), nil }
func (shapeCodec) Unmarshal(data []byte, v any) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}

var shapeDesc = grpc.ServiceDesc{
	ServiceName: "bench.Shape",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{{MethodName: "Unary", Handler: func(srv any, _ context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
		var in []byte
		if err := dec(&in); err != nil {
			return nil, err
		}
		out := srv.([]byte)
		return &out, nil
	}}},
	Streams: []grpc.StreamDesc{{StreamName: "Stream", ServerStreams: true, ClientStreams: true, Handler: func(srv any, st grpc.ServerStream) error {
		// This goroutine receives; one other sends the answers, each
		// carrying its request's id (the first 8 bytes).
		out := make(chan []byte, 64)
		var sender sync.WaitGroup
		sender.Go(func() {
			for m := range out {
				if st.SendMsg(&m) != nil {
					return
				}
			}
		})
		defer func() { close(out); sender.Wait() }()
		for {
			var in []byte
			if err := st.RecvMsg(&in); err != nil {
				if err == io.EOF {
					return nil
				}
				return err
			}
			resp := append([]byte(nil), srv.([]byte)...)
			copy(resp, in[:8])
			out <- resp
		}
	}}},
}

// shapeMux multiplexes calls over one stream by request id.
type shapeMux struct {
	st      grpc.ClientStream
	sendQ   chan []byte
	wg      sync.WaitGroup
	mu      sync.Mutex
	next    uint64
	waiting map[uint64]chan struct{}
}

func newShapeMux(ctx context.Context, cc *grpc.ClientConn) (*shapeMux, error) {
	st, err := cc.NewStream(ctx, &shapeDesc.Streams[0], "/bench.Shape/Stream")
	if err != nil {
		return nil, err
	}
	m := &shapeMux{st: st, sendQ: make(chan []byte, 64), waiting: map[uint64]chan struct{}{}}
	m.wg.Go(func() {
		for b := range m.sendQ {
			if st.SendMsg(&b) != nil {
				return
			}
		}
		_ = st.CloseSend() // the server's handler then ends, and the receiver
	})
	m.wg.Go(func() {
		for {
			var in []byte
			if st.RecvMsg(&in) != nil {
				return
			}
			id := binary.LittleEndian.Uint64(in)
			m.mu.Lock()
			ch := m.waiting[id]
			delete(m.waiting, id)
			m.mu.Unlock()
			close(ch)
		}
	})
	return m, nil
}

func (m *shapeMux) call(req []byte) error {
	ch := make(chan struct{})
	m.mu.Lock()
	m.next++
	id := m.next
	m.waiting[id] = ch
	m.mu.Unlock()
	binary.LittleEndian.PutUint64(req, id)
	m.sendQ <- req
	<-ch
	return nil
}

func (m *shapeMux) close() {
	close(m.sendQ)
	m.wg.Wait()
}
