package link

import (
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
)

// BenchmarkCopy (make bench-drain; issue 17) measures the agent-to-agent
// copy: one op is a batched CopyRequest of objects objects of size bytes
// from this agent's memory segment into reserved allocations at another
// agent's bulk transfer listener (a real data plane on loopback), answered
// per item. Each op is paired with a raw loopback TCP op moving the same
// bytes just before it (one write per object, each acknowledged by one
// byte, as internal/agent/dataplane's baseline): ratio = raw time / copy
// time over the same iterations, immune to the drift of a shared VM.
func BenchmarkCopy(b *testing.B) {
	for _, w := range []struct {
		name          string
		size, objects int
	}{
		{"size=1MiB", 1 << 20, 16},
		{"size=4KiB", 4 << 10, 256},
	} {
		b.Run(w.name, func(b *testing.B) { benchCopy(b, w.size, w.objects) })
	}
}

func benchCopy(b *testing.B, size, objects int) {
	seg := uint64(objects*size) + 1<<20
	mem, err := segment.NewMemory("mem-0", seg)
	if err != nil {
		b.Fatal(err)
	}
	l := copyLink(b, Config{}, mem)
	tgt := newCopyTarget(b, seg)
	items := make([]*masterv1.CopyItem, objects)
	for i := range objects {
		src := sealedAlloc(b, mem, fmt.Sprintf("k%d", i), pattern(size, i+1))
		dst, tok := tgt.reserve(b, fmt.Sprintf("k%d", i), size)
		items[i] = &masterv1.CopyItem{Source: &masterv1.AllocationRef{SegmentId: mem.ID(), AllocationId: src.GetAllocationId()},
			TargetTransferEndpoint: tgt.endpoint, Target: dst, TargetToken: tok}
	}
	req := &masterv1.CopyRequest{RequestId: 1, Items: items}
	op := func() {
		for i, st := range l.copyResult(b.Context(), req).GetItems() {
			if st.GetCode() != 0 {
				b.Fatalf("item %d: %v", i, st)
			}
		}
	}
	raw := newRawPair(b, size, objects)
	defer raw.close(b)
	op() // warm up: the connections, the target's pages
	var rawD, opD time.Duration
	b.ResetTimer()
	for b.Loop() {
		t0 := time.Now()
		raw.op(b)
		t1 := time.Now()
		op()
		rawD += t1.Sub(t0)
		opD += time.Since(t1)
	}
	b.StopTimer()
	total := float64(size) * float64(objects) * float64(b.N)
	b.ReportMetric(total/float64(opD.Nanoseconds()), "GB/s")
	b.ReportMetric(total/float64(rawD.Nanoseconds()), "raw-GB/s")
	b.ReportMetric(float64(objects)*float64(b.N)/opD.Seconds(), "obj/s")
	b.ReportMetric(float64(rawD)/float64(opD), "ratio")
}

// rawPair is the baseline: objects writes of size bytes over one loopback
// TCP connection, the receiver reading each into its buffer and answering
// one byte.
type rawPair struct {
	c       net.Conn
	lis     net.Listener
	done    chan error
	src     []byte
	ack     []byte
	objects int
}

func newRawPair(b *testing.B, size, objects int) *rawPair {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	r := &rawPair{lis: lis, done: make(chan error, 1), src: pattern(size, 3), ack: make([]byte, 1), objects: objects}
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
				if err == io.EOF {
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
	r.op(b) // warm up
	return r
}

func (r *rawPair) op(b *testing.B) {
	for range r.objects {
		if _, err := r.c.Write(r.src); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(r.c, r.ack); err != nil {
			b.Fatal(err)
		}
	}
}

func (r *rawPair) close(b *testing.B) {
	_ = r.c.Close()
	_ = r.lis.Close()
	if err := <-r.done; err != nil {
		b.Fatal(err)
	}
}
