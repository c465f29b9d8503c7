package segment

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var t0 = time.UnixMilli(1_700_000_000_000)

func randBytes(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, seed+1))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func newMem(t *testing.T, size uint64) *Segment {
	t.Helper()
	s, err := NewMemory("mem-0", size)
	if err != nil {
		t.Fatalf("NewMemory: %v", err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func reserve(t *testing.T, s *Segment, key string, size uint64) *masterv1.Allocation {
	t.Helper()
	a, err := s.Reserve(&masterv1.ReserveItem{SegmentId: s.ID(), Size: size, Tenant: "t", Key: key, ReplicaId: 1, GroupId: "g"}, t0)
	if err != nil {
		t.Fatalf("Reserve(%s, %d): %v", key, size, err)
	}
	return a
}

func write(t *testing.T, s *Segment, id uint64, data []byte) {
	t.Helper()
	h, err := s.OpenWrite(id)
	if err != nil {
		t.Fatalf("OpenWrite(%d): %v", id, err)
	}
	defer h.Close()
	// Write in two pieces to exercise offsets.
	half := len(data) / 2
	if err := h.WriteAt(data[:half], 0); err != nil {
		t.Fatalf("WriteAt: %v", err)
	}
	if err := h.WriteAt(data[half:], uint64(half)); err != nil {
		t.Fatalf("WriteAt: %v", err)
	}
}

func seal(s *Segment, id, sum uint64) error {
	return s.Seal([]SealArg{{ID: id, Checksum: sum}}, t0.Add(time.Second))[0]
}

func read(t *testing.T, s *Segment, id uint64) []byte {
	t.Helper()
	h, err := s.OpenRead(id)
	if err != nil {
		t.Fatalf("OpenRead(%d): %v", id, err)
	}
	defer h.Close()
	out := make([]byte, h.Size())
	if err := h.ReadAt(out, 0); err != nil {
		t.Fatalf("ReadAt: %v", err)
	}
	return out
}

func wantReason(t *testing.T, err error, want string) {
	t.Helper()
	if got := rpcerr.Reason(err); got != want {
		t.Fatalf("err = %v (reason %q), want reason %q", err, got, want)
	}
}

func TestMemoryLifecycle(t *testing.T) {
	s := newMem(t, 1<<20)
	data := randBytes(10_000, 1)
	a := reserve(t, s, "k", uint64(len(data)))
	if a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_RESERVED || a.GetSize() != 10_000 {
		t.Fatalf("Reserve = %v, want RESERVED of 10000", a)
	}
	// Not readable while RESERVED.
	_, err := s.OpenRead(a.GetAllocationId())
	wantReason(t, err, "ALLOCATION_STATE")
	write(t, s, a.GetAllocationId(), data)

	wantReason(t, seal(s, a.GetAllocationId(), checksum.Sum(data)+1), "CHECKSUM_MISMATCH")
	if got, _ := s.Lookup(a.GetAllocationId()); got.GetState() != masterv1.AllocationState_ALLOCATION_STATE_RESERVED {
		t.Fatalf("after a bad seal state = %v, want RESERVED", got.GetState())
	}
	if err := seal(s, a.GetAllocationId(), checksum.Sum(data)); err != nil {
		t.Fatalf("Seal: %v", err)
	}
	// Sealing again with the same checksum is idempotent.
	if err := seal(s, a.GetAllocationId(), checksum.Sum(data)); err != nil {
		t.Fatalf("second Seal: %v", err)
	}
	_, err = s.OpenWrite(a.GetAllocationId())
	wantReason(t, err, "ALLOCATION_STATE")
	if got := read(t, s, a.GetAllocationId()); !bytes.Equal(got, data) {
		t.Fatalf("read back %d bytes differ from written", len(got))
	}
	info := s.Info()
	if info.GetUsed() != 10_048 || info.GetCapacity() != 1<<20 || info.GetAlignment() != 64 {
		t.Fatalf("Info = %v, want used 10048 of 1MiB aligned 64", info)
	}
	if err := s.Release(a.GetAllocationId()); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if err := s.Release(a.GetAllocationId()); err != nil {
		t.Fatalf("second Release = %v, want nil (idempotent)", err)
	}
	if got := s.Info().GetUsed(); got != 0 {
		t.Fatalf("used after release = %d, want 0", got)
	}
}

func TestHandleBounds(t *testing.T) {
	s := newMem(t, 1<<16)
	a := reserve(t, s, "k", 100)
	h, err := s.OpenWrite(a.GetAllocationId())
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	tests := []struct {
		name string
		off  uint64
		n    int
	}{
		{"past end", 90, 11},
		{"offset past end", 101, 0},
		{"huge offset", ^uint64(0) - 5, 10},
		{"into alignment padding", 0, 128},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			wantReason(t, h.WriteAt(make([]byte, tc.n), tc.off), "OUT_OF_BOUNDS")
		})
	}
	if err := h.WriteAt(make([]byte, 100), 0); err != nil {
		t.Fatalf("WriteAt of exactly the size: %v", err)
	}
}

func TestWritableBytes(t *testing.T) {
	s := newMem(t, 1<<16)
	a := reserve(t, s, "k", 100)
	id := a.GetAllocationId()
	h, err := s.OpenWrite(id)
	if err != nil {
		t.Fatal(err)
	}
	b, err := h.WritableBytes(10, 90)
	if err != nil || len(b) != 90 || cap(b) != 90 {
		t.Fatalf("WritableBytes(10, 90) = len %d cap %d, %v; want 90 bytes capped", len(b), cap(b), err)
	}
	copy(b, bytes.Repeat([]byte{7}, 90))
	if _, err := h.WritableBytes(10, 91); err == nil {
		t.Fatal("WritableBytes past the end succeeded")
	} else {
		wantReason(t, err, "OUT_OF_BOUNDS")
	}
	h.Close()
	if err := seal(s, id, checksum.Sum(append(make([]byte, 10), bytes.Repeat([]byte{7}, 90)...))); err != nil {
		t.Fatalf("seal of the bytes written through the mapping: %v", err)
	}
	r, err := s.OpenRead(id)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if _, err := r.WritableBytes(0, 1); err == nil {
		t.Fatal("WritableBytes on a read handle succeeded")
	} else {
		wantReason(t, err, "ALLOCATION_STATE")
	}

	d, _, err := OpenDisk(t.TempDir(), 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	da := reserve(t, d, "k", 100)
	dh, err := d.OpenWrite(da.GetAllocationId())
	if err != nil {
		t.Fatal(err)
	}
	defer dh.Close()
	if b, err := dh.WritableBytes(0, 100); b != nil || err != nil {
		t.Fatalf("disk WritableBytes = %d bytes, %v; want nil, nil", len(b), err)
	}
}

func TestSealRefusedWhileWriting(t *testing.T) {
	s := newMem(t, 1<<16)
	a := reserve(t, s, "k", 64)
	h, err := s.OpenWrite(a.GetAllocationId())
	if err != nil {
		t.Fatal(err)
	}
	wantReason(t, seal(s, a.GetAllocationId(), 0), "ALLOCATION_STATE")
	h.Close()
	h.Close() // idempotent
	if err := seal(s, a.GetAllocationId(), checksum.Sum(make([]byte, 64))); err != nil {
		t.Fatalf("Seal after close: %v", err)
	}
}

func TestReleaseWhileReadingDefersFree(t *testing.T) {
	s := newMem(t, 4096)
	data := randBytes(4096, 2)
	a := reserve(t, s, "k", 4096)
	write(t, s, a.GetAllocationId(), data)
	if err := seal(s, a.GetAllocationId(), checksum.Sum(data)); err != nil {
		t.Fatal(err)
	}
	h, err := s.OpenRead(a.GetAllocationId())
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Release(a.GetAllocationId()); err != nil {
		t.Fatal(err)
	}
	// The extent is still held: nothing else can take it.
	if _, err := s.Reserve(&masterv1.ReserveItem{Size: 64}, t0); rpcerr.Reason(err) != "NO_AVAILABLE_HANDLE" {
		t.Fatalf("Reserve while a released extent is being read err = %v, want NO_AVAILABLE_HANDLE", err)
	}
	b, err := h.Bytes(0, 4096)
	if err != nil || !bytes.Equal(b, data) {
		t.Fatalf("Bytes after release: err %v, equal %v", err, bytes.Equal(b, data))
	}
	h.Close()
	if got := s.Info().GetUsed(); got != 0 {
		t.Fatalf("used after the reader closed = %d, want 0", got)
	}
}

func TestExpireReserved(t *testing.T) {
	s := newMem(t, 1<<16)
	old := reserve(t, s, "old", 10)
	fresh, err := s.Reserve(&masterv1.ReserveItem{Size: 10, Key: "fresh"}, t0.Add(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	sealedA := reserve(t, s, "sealed", 64)
	if err := seal(s, sealedA.GetAllocationId(), checksum.Sum(make([]byte, 64))); err != nil {
		t.Fatal(err)
	}
	got := s.ExpireReserved(t0.Add(30 * time.Second))
	if len(got) != 1 || got[0] != old.GetAllocationId() {
		t.Fatalf("ExpireReserved = %v, want [%d]", got, old.GetAllocationId())
	}
	if _, ok := s.Lookup(fresh.GetAllocationId()); !ok {
		t.Fatal("fresh reservation expired")
	}
	if _, ok := s.Lookup(sealedA.GetAllocationId()); !ok {
		t.Fatal("sealed allocation expired")
	}
}

func TestClosedSegmentRefuses(t *testing.T) {
	s, err := NewMemory("m", 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	a := reserve(t, s, "k", 64)
	h, err := s.OpenWrite(a.GetAllocationId())
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	// The open handle still works: the mapping lives until it closes.
	if err := h.WriteAt([]byte("x"), 0); err != nil {
		t.Fatalf("WriteAt on an open handle after Close: %v", err)
	}
	h.Close()
	if _, err := s.OpenWrite(a.GetAllocationId()); rpcerr.Reason(err) != "SEGMENT_UNAVAILABLE" {
		t.Fatalf("OpenWrite after Close err = %v, want SEGMENT_UNAVAILABLE", err)
	}
	if _, err := s.Reserve(&masterv1.ReserveItem{Size: 1}, t0); rpcerr.Reason(err) != "SEGMENT_UNAVAILABLE" {
		t.Fatalf("Reserve after Close err = %v, want SEGMENT_UNAVAILABLE", err)
	}
}

func TestSetBatches(t *testing.T) {
	m0, m1 := newMem(t, 1<<16), newMem(t, 1<<16)
	set := NewSet(m0, m1)
	res := set.Reserve([]*masterv1.ReserveItem{
		{SegmentId: m0.ID(), Size: 100, Key: "a"},
		{SegmentId: "nope", Size: 100, Key: "b"},
		{SegmentId: m1.ID(), Size: 1 << 20, Key: "c"},
		{SegmentId: m1.ID(), Size: 0, Key: "empty"},
	}, t0)
	wantCodes := []string{"", "SEGMENT_NOT_FOUND", "NO_AVAILABLE_HANDLE", ""}
	for i, r := range res {
		if got := r.GetStatus().GetReason(); got != wantCodes[i] {
			t.Fatalf("item %d reason %q, want %q (%v)", i, got, wantCodes[i], r)
		}
	}
	data := randBytes(100, 3)
	write(t, m0, res[0].GetAllocationId(), data)
	seals := set.Seal([]*masterv1.SealItem{
		{SegmentId: m0.ID(), AllocationId: res[0].GetAllocationId(), Checksum: checksum.Sum(data), SoftPinUntilUnixMs: 99},
		{SegmentId: m1.ID(), AllocationId: res[3].GetAllocationId(), Checksum: checksum.Sum(nil)},
		{SegmentId: m1.ID(), AllocationId: 12345},
	}, t0)
	for i, want := range []string{"", "", "ALLOCATION_NOT_FOUND"} {
		if got := seals[i].GetReason(); got != want {
			t.Fatalf("seal %d reason %q, want %q", i, got, want)
		}
	}
	tbl := set.Table()
	if len(tbl) != 2 {
		t.Fatalf("Table has %d rows, want 2", len(tbl))
	}
	for _, a := range tbl {
		if a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_SEALED {
			t.Fatalf("row %v not sealed", a)
		}
		if a.GetKey() == "a" && (a.GetSoftPinUntilUnixMs() != 99 || a.GetChecksum() != checksum.Sum(data)) {
			t.Fatalf("row %v lacks the soft pin or checksum", a)
		}
	}
	rel := set.Release([]*masterv1.AllocationRef{{SegmentId: m0.ID(), AllocationId: res[0].GetAllocationId()}, {SegmentId: "gone", AllocationId: 1}, {SegmentId: m1.ID(), AllocationId: 777}})
	for i, st := range rel {
		if st.GetCode() != 0 {
			t.Fatalf("release %d = %v, want OK", i, st)
		}
	}
	if len(set.Infos()) != 2 || len(set.Table()) != 1 {
		t.Fatalf("after release: %d infos, %d rows", len(set.Infos()), len(set.Table()))
	}
}

func TestMemoryPrefault(t *testing.T) {
	s, err := NewMemory("pf", 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Prefault(context.Background()); err != nil {
		t.Fatalf("Prefault of a fresh segment: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := s.Prefault(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Prefault with a cancelled context: got %v, want context.Canceled", err)
	}
	if _, err := s.Reserve(&masterv1.ReserveItem{SegmentId: s.ID(), Size: 4096, Key: "k"}, time.Now()); err != nil {
		t.Fatal(err)
	}
	if err := s.Prefault(context.Background()); err == nil {
		t.Fatal("Prefault of a segment holding an allocation: got nil error")
	}
}

func TestSharedMemory(t *testing.T) {
	s, err := NewSharedMemory("shared", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	fd, size, ok, err := s.DupSharedFD()
	if err != nil || !ok || size < 1<<20 {
		t.Fatalf("DupSharedFD = %d, %d, %v, %v", fd, size, ok, err)
	}
	defer unix.Close(fd)
	// A holder of the descriptor cannot shrink it under the agent's mapping.
	if err := unix.Ftruncate(fd, 0); err == nil {
		t.Fatal("a shared segment's memfd could be truncated")
	}
	peer, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(peer)
	a, err := s.Reserve(&masterv1.ReserveItem{SegmentId: s.ID(), Size: 5, Tenant: "t", Key: "k", ReplicaId: 1}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	h, err := s.OpenWrite(a.GetAllocationId())
	if err != nil {
		t.Fatal(err)
	}
	off, err := h.MapOffset(0, 5)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.MapOffset(1, 5); err == nil {
		t.Fatal("MapOffset past the object's end succeeded")
	}
	copy(peer[off:], "hello") // the peer writes through its own mapping
	got := make([]byte, 5)
	if err := h.ReadAt(got, 0); err != nil || string(got) != "hello" {
		t.Fatalf("agent reads %q, %v", got, err)
	}
	h.Close()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, _, ok, _ := s.DupSharedFD(); ok {
		t.Fatal("DupSharedFD of a closed segment")
	}
	plain, err := NewMemory("plain", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if _, _, ok, _ := plain.DupSharedFD(); ok {
		t.Fatal("DupSharedFD of an anonymous segment")
	}
}
