package segment

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

type sealedObj struct {
	alloc *masterv1.Allocation
	data  []byte
}

// fillDisk seals objects of the given sizes into a fresh disk segment in dir
// and closes it.
func fillDisk(t testing.TB, dir string, capacity uint64, sizes ...int) []sealedObj {
	t.Helper()
	s, _, err := OpenDisk(dir, capacity)
	if err != nil {
		t.Fatalf("OpenDisk: %v", err)
	}
	var out []sealedObj
	for i, n := range sizes {
		data := randBytes(n, uint64(i)+100)
		a, err := s.Reserve(&masterv1.ReserveItem{SegmentId: s.ID(), Size: uint64(n), Tenant: "t", Key: "obj-" + strconv.Itoa(i), ReplicaId: 1}, t0)
		if err != nil {
			t.Fatalf("Reserve: %v", err)
		}
		h, err := s.OpenWrite(a.GetAllocationId())
		if err != nil {
			t.Fatal(err)
		}
		if err := h.WriteAt(data, 0); err != nil {
			t.Fatal(err)
		}
		h.Close()
		if err := seal(s, a.GetAllocationId(), checksum.Sum(data)); err != nil {
			t.Fatalf("Seal: %v", err)
		}
		out = append(out, sealedObj{a, data})
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestVerifySealedDropsCorrupt: a byte flipped in one sealed object while
// the segment was closed is found on reopen; that allocation leaves the
// table (and the journal), its extent is freed, reads of it answer
// DATA_LOSS CHECKSUM_MISMATCH, and every other object reads back intact.
func TestVerifySealedDropsCorrupt(t *testing.T) {
	dir := t.TempDir()
	// The middle object spans many verify buffers.
	objs := fillDisk(t, dir, 8<<20, 10_000, 3<<20, 0, 70_000)
	bad := objs[1]
	testutil.FlipByte(t, filepath.Join(dir, dataName), bad.alloc.GetOffset()+2<<20+17)

	s, _, err := OpenDisk(dir, 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	usedBefore := s.Info().GetUsed()
	// A fake clock one second per reading, progress every second: a
	// report per buffer.
	clock := t0
	var progress []VerifyProgress
	rep, err := s.VerifySealed(t.Context(), VerifyConfig{
		BufferSize: 256 << 10, ProgressEvery: time.Second,
		Now:      func() time.Time { clock = clock.Add(time.Second); return clock },
		Progress: func(p VerifyProgress) { progress = append(progress, p) },
	})
	if err != nil {
		t.Fatalf("VerifySealed: %v", err)
	}
	var total uint64
	for _, o := range objs {
		total += uint64(len(o.data))
	}
	if rep.Allocations != len(objs) || rep.Bytes != total || rep.CorruptCount != 1 || len(rep.Corrupt) != 1 {
		t.Fatalf("report = %+v, want %d allocations, %d bytes, 1 corrupt", rep, len(objs), total)
	}
	c := rep.Corrupt[0]
	if c.ID != bad.alloc.GetAllocationId() || c.Key != bad.alloc.GetKey() || c.Tenant != "t" || c.Want != checksum.Sum(bad.data) || c.Got == c.Want || c.Err != nil {
		t.Fatalf("corrupt = %+v, want allocation %d (%s)", c, bad.alloc.GetAllocationId(), bad.alloc.GetKey())
	}
	if len(progress) < 3 {
		t.Fatalf("%d progress reports, want one per buffer", len(progress))
	}
	for i := 1; i < len(progress); i++ {
		if progress[i].VerifiedBytes < progress[i-1].VerifiedBytes {
			t.Fatalf("progress went backwards: %+v then %+v", progress[i-1], progress[i])
		}
	}
	if last := progress[len(progress)-1]; last.VerifiedBytes != total || last.TotalBytes != total || last.Corrupt != 1 || last.Allocations != len(objs) {
		t.Fatalf("last progress = %+v, want %d of %d bytes, 1 corrupt", last, total, total)
	}

	if _, ok := s.Lookup(bad.alloc.GetAllocationId()); ok {
		t.Fatal("corrupt allocation still in the table (would be registered and served)")
	}
	for _, a := range s.Table() {
		if a.GetAllocationId() == bad.alloc.GetAllocationId() {
			t.Fatal("corrupt allocation in Table()")
		}
	}
	_, err = s.OpenRead(bad.alloc.GetAllocationId())
	wantReason(t, err, "CHECKSUM_MISMATCH")
	if got := status.Code(rpcerr.Status(err)); got != codes.DataLoss {
		t.Fatalf("code = %v, want DataLoss", got)
	}
	if got, want := s.Info().GetUsed(), usedBefore-(3<<20); got != want {
		t.Fatalf("used = %d, want %d (the corrupt extent freed)", got, want)
	}
	for i, o := range objs {
		if i == 1 {
			continue
		}
		if b := read(t, s, o.alloc.GetAllocationId()); !bytes.Equal(b, o.data) {
			t.Fatalf("intact object %s differs", o.alloc.GetKey())
		}
	}
	// A release of the dropped id (the master removing the replica) is a no-op.
	if err := s.Release(bad.alloc.GetAllocationId()); err != nil {
		t.Fatalf("Release of a dropped id: %v", err)
	}
	// The freed extent takes new objects.
	a := reserve(t, s, "new", 3<<20)
	write(t, s, a.GetAllocationId(), randBytes(3<<20, 7))
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	// The drop is journaled: the next reopen does not bring it back.
	s2, rec, err := OpenDisk(dir, 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if rec.Sealed != len(objs)-1 {
		t.Fatalf("sealed after second reopen = %d, want %d", rec.Sealed, len(objs)-1)
	}
	rep, err = s2.VerifySealed(t.Context(), VerifyConfig{})
	if err != nil || len(rep.Corrupt) != 0 || rep.Allocations != len(objs)-1 {
		t.Fatalf("second verify = %+v, %v; want clean", rep, err)
	}
}

// TestVerifySealedBoundedMemory: verifying a segment allocates one buffer,
// whatever the number and size of its objects.
func TestVerifySealedBoundedMemory(t *testing.T) {
	dir := t.TempDir()
	sizes := make([]int, 0, 40)
	for i := range 40 {
		sizes = append(sizes, 100_000+i*13_000)
	}
	sizes = append(sizes, 6<<20)
	fillDisk(t, dir, 32<<20, sizes...)
	s, _, err := OpenDisk(dir, 32<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	const buf = 1 << 20
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	rep, err := s.VerifySealed(t.Context(), VerifyConfig{BufferSize: buf})
	runtime.ReadMemStats(&after)
	if err != nil || len(rep.Corrupt) != 0 {
		t.Fatalf("VerifySealed = %+v, %v", rep, err)
	}
	if rep.Bytes < 10<<20 {
		t.Fatalf("verified %d bytes, want > 10 MiB", rep.Bytes)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > buf+256<<10 {
		t.Fatalf("verifying %d bytes allocated %d bytes, want about one %d-byte buffer", rep.Bytes, got, buf)
	}
}

// TestVerifySealedHonoursContext: a cancelled verification stops with the
// context's error and drops nothing.
func TestVerifySealedHonoursContext(t *testing.T) {
	dir := t.TempDir()
	objs := fillDisk(t, dir, 4<<20, 1<<20, 1<<20)
	testutil.FlipByte(t, filepath.Join(dir, dataName), objs[1].alloc.GetOffset())
	s, _, err := OpenDisk(dir, 4<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := s.VerifySealed(ctx, VerifyConfig{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("VerifySealed(cancelled) = %v, want context.Canceled", err)
	}
	if len(s.Table()) != 2 {
		t.Fatalf("a cancelled verification changed the table: %d rows", len(s.Table()))
	}
}

// BenchmarkVerifySealed measures verification throughput of a 256 MiB disk
// segment full of 1 MiB objects, from the disk: the data file's pages are
// dropped from the page cache before each pass (it is synced, so
// FADV_DONTNEED evicts them). MB/s extrapolates the start-up cost of a
// large segment (64 GiB / rate).
func BenchmarkVerifySealed(b *testing.B) {
	const objSize = 1 << 20
	dir := b.TempDir()
	sizes := make([]int, 255)
	for i := range sizes {
		sizes[i] = objSize
	}
	fillDisk(b, dir, 256<<20, sizes...)
	s, _, err := OpenDisk(dir, 256<<20)
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	f := s.store.(*disk).f
	b.SetBytes(int64(len(sizes)) * objSize)
	b.ResetTimer()
	for b.Loop() {
		b.StopTimer()
		if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		rep, err := s.VerifySealed(b.Context(), VerifyConfig{})
		if err != nil || len(rep.Corrupt) != 0 {
			b.Fatalf("VerifySealed = %+v, %v", rep, err)
		}
	}
}

// TestVerifySealedWholeDiskBad: when every object is corrupt, every one is
// dropped and counted, and the report's details stay bounded.
func TestVerifySealedWholeDiskBad(t *testing.T) {
	dir := t.TempDir()
	const n = MaxCorruptDetails + 100
	sizes := make([]int, n)
	for i := range sizes {
		sizes[i] = 100
	}
	objs := fillDisk(t, dir, 8<<20, sizes...)
	f, err := os.OpenFile(filepath.Join(dir, dataName), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		if _, err := f.WriteAt([]byte("!!"), int64(o.alloc.GetOffset())); err != nil {
			t.Fatal(err)
		}
	}
	_ = f.Close()
	s, _, err := OpenDisk(dir, 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	rep, err := s.VerifySealed(t.Context(), VerifyConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if rep.CorruptCount != n || len(rep.Corrupt) != MaxCorruptDetails {
		t.Fatalf("CorruptCount %d with %d details, want %d with %d", rep.CorruptCount, len(rep.Corrupt), n, MaxCorruptDetails)
	}
	if len(s.Table()) != 0 || s.Info().GetUsed() != 0 {
		t.Fatalf("after dropping all: %d rows, %d bytes used; want none", len(s.Table()), s.Info().GetUsed())
	}
}
