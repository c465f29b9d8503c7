package segment

import (
	"bytes"
	"strings"
	"sync"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
)

// reserveBlank reserves a blank of size bytes at now. The item also
// carries an identity, which a blank must ignore.
func reserveBlank(t *testing.T, s *Segment, size uint64, now time.Time) uint64 {
	t.Helper()
	a, err := s.Reserve(&masterv1.ReserveItem{SegmentId: s.ID(), Size: size, Blank: true,
		Tenant: "ignored", Key: "ignored", ReplicaId: 7, GroupId: "ignored", HardPin: true, SoftPinUntilUnixMs: 9}, now)
	if err != nil {
		t.Fatalf("Reserve(blank): %v", err)
	}
	if a.GetTenant() != "" || a.GetKey() != "" || a.GetReplicaId() != 0 || a.GetGroupId() != "" || a.GetHardPin() || a.GetSoftPinUntilUnixMs() != 0 {
		t.Fatalf("Reserve(blank) = %v, want no identity", a)
	}
	return a.GetAllocationId()
}

// who is the identity a write token names.
func who(tenant, key string) Identity {
	return Identity{Tenant: []byte(tenant), Key: []byte(key), Group: []byte("grp"), ReplicaID: 2, HardPin: true}
}

func openAs(s *Segment, id uint64, w Identity, now time.Time) (*Handle, error) {
	h := new(Handle)
	if err := s.OpenWriteAs(h, id, w, now); err != nil {
		return nil, err
	}
	return h, nil
}

// viewRows fills a whole view.
func viewRows(v *TableView) []*masterv1.Allocation {
	out := make([]*masterv1.Allocation, v.Len())
	for i := range out {
		out[i] = &masterv1.Allocation{}
	}
	v.Fill(out, 0)
	return out
}

func wantIdentity(t *testing.T, a *masterv1.Allocation, tenant, key string) {
	t.Helper()
	if a.GetTenant() != tenant || a.GetKey() != key || a.GetGroupId() != "grp" || a.GetReplicaId() != 2 || !a.GetHardPin() {
		t.Fatalf("allocation %v, want %s/%s replica 2 group grp hard-pinned", a, tenant, key)
	}
}

// TestBlankBindsOnWriteOpen: a blank refuses reads, seals and writes that
// name no object and is listed in Table and View flagged blank, with no
// object; the first OpenWriteAs
// records the token's identity (copied), which a second write must name;
// the bytes written then seal and read back under that identity.
func TestBlankBindsOnWriteOpen(t *testing.T) {
	s := newMem(t, 1<<20)
	other := reserve(t, s, "other", 10)
	id := reserveBlank(t, s, 5000, t0)

	if a, ok := s.Lookup(id); !ok || a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_RESERVED || a.GetKey() != "" {
		t.Fatalf("Lookup(blank) = %v, %v", a, ok)
	}
	_, err := s.OpenRead(id)
	wantReason(t, err, "ALLOCATION_STATE")
	err = seal(s, id, checksum.Sum(make([]byte, 5000)))
	wantReason(t, err, "ALLOCATION_STATE")
	if !strings.Contains(err.Error(), "blank") {
		t.Fatalf("Seal of a blank: %v, want it to say blank", err)
	}
	_, err = s.OpenWrite(id)
	wantReason(t, err, "ALLOCATION_STATE")
	// listedBlank checks that rows list other as itself and the blank
	// flagged, with no object.
	listedBlank := func(what string, rows []*masterv1.Allocation) {
		t.Helper()
		var n int
		for _, r := range rows {
			switch r.GetAllocationId() {
			case other.GetAllocationId():
				n++
				if r.GetBlank() || r.GetKey() != "other" {
					t.Fatalf("%s: %v, want the reservation of other", what, r)
				}
			case id:
				n++
				if !r.GetBlank() || r.GetKey() != "" || r.GetTenant() != "" ||
					r.GetState() != masterv1.AllocationState_ALLOCATION_STATE_RESERVED {
					t.Fatalf("%s: %v, want the blank flagged, RESERVED, with no object", what, r)
				}
			}
		}
		if n != 2 || len(rows) != 2 {
			t.Fatalf("%s = %v, want other's reservation and the blank", what, rows)
		}
	}
	listedBlank("Table", s.Table())
	before := s.View()
	listedBlank("View", viewRows(before))
	if _, reserved, sealed := s.Stats(); reserved != 2 || sealed != 0 {
		t.Fatalf("Stats: %d reserved, %d sealed; want the blank counted reserved", reserved, sealed)
	}

	// The first write binds; its identity's bytes are copied (a token's
	// bytes are reused once the request is done).
	w := who("t", "k")
	h, err := openAs(s, id, w, t0.Add(time.Second))
	if err != nil {
		t.Fatalf("OpenWriteAs(blank): %v", err)
	}
	w.Tenant[0], w.Key[0], w.Group[0] = 'X', 'X', 'X'
	a, _ := s.Lookup(id)
	wantIdentity(t, a, "t", "k")
	if a.GetCreatedUnixMs() != t0.Add(time.Second).UnixMilli() {
		t.Fatalf("created %d after the bind, want the bind's time %d", a.GetCreatedUnixMs(), t0.Add(time.Second).UnixMilli())
	}
	// Bound, it is an ordinary reservation: another object's write is
	// refused and changes nothing; the same object's is let in.
	for _, bad := range []Identity{who("u", "k"), who("t", "other"), {}} {
		_, err := openAs(s, id, bad, t0.Add(2*time.Second))
		wantReason(t, err, "INVALID_TOKEN")
	}
	if a, _ := s.Lookup(id); a.GetTenant() != "t" || a.GetKey() != "k" {
		t.Fatalf("after refused binds: %v", a)
	}
	h2, err := openAs(s, id, who("t", "k"), t0.Add(2*time.Second))
	if err != nil {
		t.Fatalf("second OpenWriteAs with the same object: %v", err)
	}
	h2.Close()
	if a, _ := s.Lookup(id); a.GetCreatedUnixMs() != t0.Add(time.Second).UnixMilli() {
		t.Fatalf("a second write moved created to %d", a.GetCreatedUnixMs())
	}
	// A view taken before the bind shows it bound now (as a view taken
	// a moment later would), no longer blank.
	for _, r := range viewRows(before) {
		if r.GetAllocationId() == id && (r.GetBlank() || r.GetKey() != "k") {
			t.Fatalf("a view taken before the bind shows %v after it", r)
		}
	}

	data := randBytes(5000, 3)
	if err := h.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	h.Close()
	if err := seal(s, id, checksum.Sum(data)); err != nil {
		t.Fatalf("Seal of a bound blank: %v", err)
	}
	if got := read(t, s, id); !bytes.Equal(got, data) {
		t.Fatal("bound blank reads back other bytes")
	}
	a, _ = s.Lookup(id)
	if a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_SEALED {
		t.Fatalf("state %v after Seal", a.GetState())
	}
	wantIdentity(t, a, "t", "k")
	var found bool
	for _, r := range viewRows(s.View()) {
		if r.GetAllocationId() == id {
			found = true
			wantIdentity(t, r, "t", "k")
		}
	}
	if !found {
		t.Fatal("View after the seal leaves the bound blank out")
	}
}

// TestBlankSealReceived: a blank bound by the write that wrote it whole
// seals from the checksum computed on receipt, under its identity.
func TestBlankSealReceived(t *testing.T) {
	s := newMem(t, 1<<20)
	id := reserveBlank(t, s, 4096, t0)
	h, err := openAs(s, id, who("t", "k"), t0)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	dst, err := h.WritableBytes(0, 4096)
	if err != nil {
		t.Fatal(err)
	}
	copy(dst, randBytes(4096, 5))
	sum := checksum.Sum(dst)
	if err := h.SealReceived(sum, sum, t0); err != nil {
		t.Fatalf("SealReceived of a bound blank: %v", err)
	}
	a, _ := s.Lookup(id)
	if a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_SEALED || a.GetChecksum() != sum {
		t.Fatalf("after SealReceived: %v", a)
	}
	wantIdentity(t, a, "t", "k")
}

// TestBlankBindRace: writes naming two objects open one blank at once;
// exactly one binds it, the other is refused, and the allocation holds the
// winner's object.
func TestBlankBindRace(t *testing.T) {
	s := newMem(t, 1<<20)
	for round := range 50 {
		id := reserveBlank(t, s, 64, t0)
		keys := []string{"a", "b"}
		errs := make([]error, len(keys))
		var wg sync.WaitGroup
		for i, k := range keys {
			wg.Go(func() {
				h, err := openAs(s, id, who("t", k), t0)
				if err == nil {
					h.Close()
				}
				errs[i] = err
			})
		}
		wg.Wait()
		a, _ := s.Lookup(id)
		winner := -1
		for i, err := range errs {
			if err == nil {
				if winner >= 0 {
					t.Fatalf("round %d: both writes bound the blank", round)
				}
				winner = i
			} else {
				wantReason(t, err, "INVALID_TOKEN")
			}
		}
		if winner < 0 || a.GetKey() != keys[winner] {
			t.Fatalf("round %d: errors %v, allocation %v", round, errs, a)
		}
		if err := s.Release(id); err != nil {
			t.Fatal(err)
		}
	}
}

// TestBlankExpiryCountsFromBind: an unbound blank expires a grace after its
// reservation, a bound one a grace after its binding, and a bound blank's
// earlier place in the reservation queue holds back no older reservation.
func TestBlankExpiryCountsFromBind(t *testing.T) {
	s := newMem(t, 1<<20)
	bound := reserveBlank(t, s, 64, t0)
	unbound := reserveBlank(t, s, 64, t0)
	plain := reserve(t, s, "plain", 64) // at t0
	plainLater, err := s.Reserve(&masterv1.ReserveItem{SegmentId: s.ID(), Size: 64, Tenant: "t", Key: "later"}, t0.Add(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	bind := t0.Add(10 * time.Second)
	h, err := openAs(s, bound, who("t", "k"), bind)
	if err != nil {
		t.Fatal(err)
	}
	h.Close()

	got := s.ExpireReserved(t0.Add(5 * time.Second))
	want := []uint64{unbound, plain.GetAllocationId(), plainLater.GetAllocationId()}
	if !sameIDs(got, want) {
		t.Fatalf("ExpireReserved(t0+5s) = %v, want %v (all but the blank bound at t0+10s)", got, want)
	}
	if got := s.ExpireReserved(bind); len(got) != 0 {
		t.Fatalf("ExpireReserved(bind time) = %v, want nothing", got)
	}
	if _, ok := s.Lookup(bound); !ok {
		t.Fatal("the bound blank expired before a grace from its bind")
	}
	if got := s.ExpireReserved(bind.Add(time.Millisecond)); !sameIDs(got, []uint64{bound}) {
		t.Fatalf("ExpireReserved(bind+1ms) = %v, want [%d]", got, bound)
	}
	if n := len(s.resQ); n != 0 {
		t.Fatalf("reservation queue holds %d places after everything expired", n)
	}
}

func sameIDs(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	seen := map[uint64]int{}
	for _, id := range a {
		seen[id]++
	}
	for _, id := range b {
		if seen[id]--; seen[id] < 0 {
			return false
		}
	}
	return true
}

// TestDiskBlankSurvivesRestartBound: a disk segment journals a bound and
// sealed blank with the identity its write named, so it is back after a
// reopen; an unbound blank, RESERVED, is not.
func TestDiskBlankSurvivesRestartBound(t *testing.T) {
	dir := t.TempDir()
	s, _, err := OpenDisk(dir, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	id := reserveBlank(t, s, 6000, t0)
	unbound := reserveBlank(t, s, 100, t0)
	h, err := openAs(s, id, who("t", "k"), t0.Add(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	data := randBytes(6000, 8)
	if err := h.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	h.Close()
	if err := seal(s, id, checksum.Sum(data)); err != nil {
		t.Fatalf("Seal: %v", err)
	}
	wantReason(t, seal(s, unbound, checksum.Sum(make([]byte, 100))), "ALLOCATION_STATE")
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	s2, rec, err := OpenDisk(dir, 1<<20)
	if err != nil {
		t.Fatalf("reopen: %v", err)
	}
	defer s2.Close()
	if rec.Sealed != 1 {
		t.Fatalf("Recovery = %+v, want 1 sealed", rec)
	}
	a, ok := s2.Lookup(id)
	if !ok || a.GetState() != masterv1.AllocationState_ALLOCATION_STATE_SEALED || a.GetChecksum() != checksum.Sum(data) ||
		a.GetCreatedUnixMs() != t0.Add(time.Second).UnixMilli() {
		t.Fatalf("bound blank after restart = %v, %v", a, ok)
	}
	wantIdentity(t, a, "t", "k")
	if got := read(t, s2, id); !bytes.Equal(got, data) {
		t.Fatal("bound blank's bytes differ after restart")
	}
	if _, ok := s2.Lookup(unbound); ok {
		t.Fatal("an unbound blank survived the restart")
	}
}
