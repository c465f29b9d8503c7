package dataplane

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/server"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
)

// benchChunk is the message size of the gRPC benchmarks (Write messages and
// the Read chunk size): CRESCENT_BENCH_CHUNK bytes, default DefaultChunkSize.
var benchChunk = func() int {
	if v, err := strconv.Atoi(os.Getenv("CRESCENT_BENCH_CHUNK")); err == nil && v > 0 {
		return v
	}
	return DefaultChunkSize
}()

var benchSizes = []struct {
	name string
	size int
}{
	{"4KiB", 4 << 10}, {"64KiB", 64 << 10}, {"1MiB", 1 << 20}, {"64MiB", 64 << 20},
}

// BenchmarkDataPlane measures DataService Write and Read over loopback TCP
// through the production server bootstrap (internal/server, with its
// interceptors), and the bulk transfer protocol (internal/xfer.Pool against
// ServeTransfer), against a raw TCP stream copy of the same bytes. Each raw
// op sends size bytes, the receiver reads them into a buffer and answers one
// byte, like the unary answer that ends a Write. Every non-raw op is paired
// with a raw op run just before it (measure): ratio = raw time / op time
// over the same iterations.
func BenchmarkDataPlane(b *testing.B) {
	for _, sz := range benchSizes {
		b.Run("size="+sz.name, func(b *testing.B) {
			b.Run("raw", func(b *testing.B) { benchRaw(b, sz.size) })
			b.Run("write", func(b *testing.B) { benchGRPC(b, sz.size, true, false) })
			b.Run("read", func(b *testing.B) { benchGRPC(b, sz.size, false, false) })
			b.Run("read-direct", func(b *testing.B) { benchGRPC(b, sz.size, false, true) })
			b.Run("xfer-write", func(b *testing.B) { benchXfer(b, sz.size, true) })
			b.Run("xfer-read", func(b *testing.B) { benchXfer(b, sz.size, false) })
		})
	}
}

// rawLink is the baseline: a plain net.Conn writer and a receiver that
// reads size bytes into a buffer and answers one byte, like the unary
// answer that ends a Write.
type rawLink struct {
	c     net.Conn
	lis   net.Listener
	done  chan error
	src   []byte
	ack   []byte
	chunk int
}

func newRawLink(b *testing.B, size int) *rawLink {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	r := &rawLink{lis: lis, done: make(chan error, 1), ack: make([]byte, 1), chunk: min(size, DefaultChunkSize)}
	go func() {
		c, err := lis.Accept()
		if err != nil {
			r.done <- err
			return
		}
		defer c.Close()
		dst := make([]byte, size)
		for {
			if _, err := io.ReadFull(c, dst); err != nil {
				if errors.Is(err, io.EOF) {
					err = nil
				}
				r.done <- err
				return
			}
			if _, err := c.Write([]byte{1}); err != nil {
				r.done <- err
				return
			}
		}
	}()
	if r.c, err = net.Dial("tcp", lis.Addr().String()); err != nil {
		b.Fatal(err)
	}
	r.src = make([]byte, size)
	for i := range r.src {
		r.src[i] = byte(i)
	}
	r.op(b) // warm up: first touch of the buffers
	return r
}

func (r *rawLink) op(b *testing.B) {
	for off := 0; off < len(r.src); off += r.chunk {
		if _, err := r.c.Write(r.src[off : off+r.chunk]); err != nil {
			b.Fatal(err)
		}
	}
	if _, err := io.ReadFull(r.c, r.ack); err != nil {
		b.Fatal(err)
	}
}

func (r *rawLink) close(b *testing.B) {
	_ = r.c.Close()
	_ = r.lis.Close()
	if err := <-r.done; err != nil {
		b.Fatal(err)
	}
}

func benchRaw(b *testing.B, size int) {
	r := newRawLink(b, size)
	b.SetBytes(int64(size))
	b.ResetTimer()
	for b.Loop() {
		r.op(b)
	}
	b.StopTimer()
	r.close(b)
	b.ReportMetric(float64(size)*float64(b.N)/float64(b.Elapsed().Nanoseconds()), "GB/s")
}

// benchAlloc reserves a size-byte allocation in mem and returns its id,
// bytes to write into it, and a write and a read token for it.
func benchAlloc(b *testing.B, mem *segment.Segment, key token.SigningKey, size int) (id uint64, src, wtok, rtok []byte) {
	a, err := mem.Reserve(&masterv1.ReserveItem{SegmentId: mem.ID(), Size: uint64(size), Key: "bench"}, time.Now())
	if err != nil {
		b.Fatal(err)
	}
	id = a.GetAllocationId()
	src = make([]byte, size)
	for i := range src {
		src[i] = byte(i * 31)
	}
	exp := time.Now().Add(time.Hour)
	wtok = token.Sign(key, token.Claims{Mode: token.Write, Key: "bench", SegmentID: mem.ID(), AllocationID: id, Expiry: exp})
	rtok = token.Sign(key, token.Claims{Mode: token.Read, Key: "bench", SegmentID: mem.ID(), AllocationID: id, Expiry: exp})
	return id, src, wtok, rtok
}

// measure runs op b.N times, each paired with one raw TCP op of the same
// size just before it, and reports op's GB/s, the raw GB/s and ratio = raw
// time / op time over the same interleaved iterations. Pairing makes the
// ratio immune to the drift of a shared VM, which moved the raw baseline
// by 1.6x between consecutive runs of the same benchmark.
func measure(b *testing.B, size int, op func() error) {
	r := newRawLink(b, size)
	defer r.close(b)
	var rawD, opD time.Duration
	b.ResetTimer()
	for b.Loop() {
		t0 := time.Now()
		r.op(b)
		t1 := time.Now()
		if err := op(); err != nil {
			b.Fatal(err)
		}
		rawD += t1.Sub(t0)
		opD += time.Since(t1)
	}
	b.StopTimer()
	total := float64(size) * float64(b.N)
	b.ReportMetric(total/float64(opD.Nanoseconds()), "GB/s")
	b.ReportMetric(total/float64(rawD.Nanoseconds()), "raw-GB/s")
	b.ReportMetric(float64(rawD)/float64(opD), "ratio")
}

// benchGRPC measures one Write or Read per op. direct reads with
// directCodec (data copied from the transport's buffers into dst once)
// instead of the standard client codec.
func benchGRPC(b *testing.B, size int, write, direct bool) {
	mem, err := segment.NewMemory("bench", uint64(size)+4096)
	if err != nil {
		b.Fatal(err)
	}
	defer mem.Close()
	set := segment.NewSet(mem)
	keys := &Keyring{}
	key := token.SigningKey{ID: 1, Secret: token.NewKey()}
	keys.Set(tokenKeys(key))
	lg := testutil.Logger()
	reg := obs.NewRegistry()
	opts := ServerOptions()
	if os.Getenv("CRESCENT_BENCH_CODEC") == "standard" {
		opts = transportOptions() // for A/B runs against the standard codec
	}
	srv := server.New(server.Config{GRPCAddr: "127.0.0.1:0", ShutdownTimeout: time.Second}, lg, reg, opts...)
	agentv1.RegisterDataServiceServer(srv.GRPC, New(Config{}, Deps{Segments: set, Keys: keys, Registerer: reg}, lg))
	if err := srv.Listen(); err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	go func() { runDone <- srv.Run(ctx) }()
	defer func() {
		cancel()
		<-runDone
	}()
	conn, err := grpc.NewClient(srv.GRPCAddr(), append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, DialOptions()...)...)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	client := agentv1.NewDataServiceClient(conn)

	id, src, wtok, rtok := benchAlloc(b, mem, key, size)
	writeOnce := func() error {
		st, err := client.Write(ctx)
		if err != nil {
			return err
		}
		for off := 0; off < size; off += benchChunk {
			m := &agentv1.WriteRequest{Data: src[off:min(off+benchChunk, size)]}
			if off == 0 {
				m.Header = &agentv1.WriteHeader{SegmentId: mem.ID(), AllocationId: id, Token: wtok}
			}
			if err := st.Send(m); err != nil {
				break
			}
		}
		resp, err := st.CloseAndRecv()
		if err == nil && resp.GetBytesWritten() != uint64(size) {
			err = fmt.Errorf("wrote %d of %d", resp.GetBytesWritten(), size)
		}
		return err
	}
	dst := make([]byte, size)
	readOnce := func() error {
		st, err := client.Read(ctx, &agentv1.ReadRequest{SegmentId: mem.ID(), AllocationId: id, Token: rtok, ChunkSize: uint32(benchChunk)})
		if err != nil {
			return err
		}
		n := 0
		for {
			m, err := st.Recv()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return err
			}
			n += copy(dst[n:], m.GetData())
		}
		if n != size {
			return fmt.Errorf("read %d of %d", n, size)
		}
		return nil
	}
	readDirect := func() error {
		st, err := client.Read(ctx, &agentv1.ReadRequest{SegmentId: mem.ID(), AllocationId: id, Token: rtok, ChunkSize: uint32(benchChunk)},
			grpc.ForceCodecV2(directCodec{base: encoding.GetCodecV2("proto")}))
		if err != nil {
			return err
		}
		d := &directRead{dst: dst}
		for {
			if err := st.RecvMsg(d); errors.Is(err, io.EOF) {
				break
			} else if err != nil {
				return err
			}
		}
		if d.n != size {
			return fmt.Errorf("read %d of %d", d.n, size)
		}
		return nil
	}
	if !write {
		if err := writeOnce(); err != nil {
			b.Fatal(err)
		}
		if err := mem.Seal([]segment.SealArg{{ID: id, Checksum: checksum.Sum(src)}}, time.Now())[0]; err != nil {
			b.Fatal(err)
		}
	}
	op := readOnce
	switch {
	case write:
		op = writeOnce
	case direct:
		op = readDirect
	}
	// Warm up: the first op faults in the segment's pages and the
	// connection's buffers; the benchmark measures the steady state.
	if err := op(); err != nil {
		b.Fatal(err)
	}
	measure(b, size, op)
}

// benchXfer measures one bulk transfer Write or Read of one object per op
// (internal/xfer.Pool against ServeTransfer over loopback TCP, memory segment).
func benchXfer(b *testing.B, size int, write bool) {
	mem, err := segment.NewMemory("bench", uint64(size)+4096)
	if err != nil {
		b.Fatal(err)
	}
	defer mem.Close()
	keys := &Keyring{}
	key := token.SigningKey{ID: 1, Secret: token.NewKey()}
	keys.Set(tokenKeys(key))
	lg := testutil.Logger()
	srv := New(Config{}, Deps{Segments: segment.NewSet(mem), Keys: keys, Registerer: obs.NewRegistry()}, lg)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- srv.ServeTransfer(ctx, lis) }()
	pool := xfer.NewPool(xfer.Config{})
	defer func() {
		_ = pool.Close()
		cancel()
		if err := <-served; err != nil {
			b.Error(err)
		}
	}()

	id, src, wtok, rtok := benchAlloc(b, mem, key, size)
	witems := []*agentv1.TransferItem{{SegmentId: mem.ID(), AllocationId: id, Token: wtok}}
	ritems := []*agentv1.TransferItem{{SegmentId: mem.ID(), AllocationId: id, Token: rtok}}
	srcs, dsts := [][]byte{src}, [][]byte{make([]byte, size)}
	addr := lis.Addr().String()
	writeOnce := func() error {
		errs, err := pool.Write(ctx, addr, witems, srcs)
		if err == nil {
			err = errs[0]
		}
		return err
	}
	readOnce := func() error {
		res, err := pool.Read(ctx, addr, ritems, dsts)
		if err == nil {
			err = res[0].Err
		}
		return err
	}
	op := writeOnce
	if !write {
		if err := writeOnce(); err != nil {
			b.Fatal(err)
		}
		if err := mem.Seal([]segment.SealArg{{ID: id, Checksum: checksum.Sum(src)}}, time.Now())[0]; err != nil {
			b.Fatal(err)
		}
		op = readOnce
	}
	// Warm up: page faults of the segment and the destination, the
	// pooled connection.
	if err := op(); err != nil {
		b.Fatal(err)
	}
	measure(b, size, op)
	if !write && !bytes.Equal(dsts[0], src) {
		b.Fatal("read bytes differ from the written ones")
	}
}
