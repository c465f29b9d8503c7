package segment

import (
	"errors"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
)

// TestSealReceived: a write that was the allocation's only one seals it
// from the checksum computed on receipt; one that another write overlapped
// (or a mismatch, or a released allocation) does not.
func TestSealReceived(t *testing.T) {
	data := randBytes(4096, 1)
	sum := checksum.Sum(data)
	fill := func(t *testing.T, h *Handle) {
		t.Helper()
		if err := h.WriteAt(data, 0); err != nil {
			t.Fatal(err)
		}
	}
	state := func(s *Segment, id uint64) masterv1.AllocationState {
		a, _ := s.Lookup(id)
		return a.GetState()
	}
	t.Run("alone", func(t *testing.T) {
		s := newMem(t, 1<<20)
		a := reserve(t, s, "k", uint64(len(data)))
		h, err := s.OpenWrite(a.GetAllocationId())
		if err != nil {
			t.Fatal(err)
		}
		fill(t, h)
		if err := h.SealReceived(sum, sum, t0); err != nil {
			t.Fatalf("SealReceived = %v", err)
		}
		h.Close()
		if got := state(s, a.GetAllocationId()); got != masterv1.AllocationState_ALLOCATION_STATE_SEALED {
			t.Fatalf("state %v", got)
		}
		if !equalBytes(read(t, s, a.GetAllocationId()), data) {
			t.Fatal("bytes differ")
		}
		// The master's Seal that may follow (no receipt) answers OK.
		if err := seal(s, a.GetAllocationId(), sum); err != nil {
			t.Fatalf("Seal after SealReceived = %v", err)
		}
	})
	t.Run("mismatch", func(t *testing.T) {
		s := newMem(t, 1<<20)
		a := reserve(t, s, "k", uint64(len(data)))
		h, _ := s.OpenWrite(a.GetAllocationId())
		defer h.Close()
		fill(t, h)
		wantReason(t, h.SealReceived(sum+1, sum, t0), "CHECKSUM_MISMATCH")
		if got := state(s, a.GetAllocationId()); got != masterv1.AllocationState_ALLOCATION_STATE_RESERVED {
			t.Fatalf("state %v", got)
		}
	})
	later := func(t *testing.T, name string, setup func(s *Segment, id uint64, h *Handle) (*Handle, func())) {
		t.Run(name, func(t *testing.T) {
			s := newMem(t, 1<<20)
			a := reserve(t, s, "k", uint64(len(data)))
			id := a.GetAllocationId()
			h0, err := s.OpenWrite(id)
			if err != nil {
				t.Fatal(err)
			}
			h, done := setup(s, id, h0)
			defer done()
			fill(t, h)
			if err := h.SealReceived(sum, sum, t0); !errors.Is(err, ErrSealLater) {
				t.Fatalf("SealReceived = %v, want ErrSealLater", err)
			}
			want := masterv1.AllocationState_ALLOCATION_STATE_RESERVED
			if name == "released" {
				want = masterv1.AllocationState_ALLOCATION_STATE_UNSPECIFIED // gone
			}
			if got := state(s, id); got != want {
				t.Fatalf("state %v, want %v", got, want)
			}
		})
	}
	later(t, "another write open", func(s *Segment, id uint64, h *Handle) (*Handle, func()) {
		other, _ := s.OpenWrite(id)
		return h, func() { h.Close(); other.Close() }
	})
	later(t, "another write came and went", func(s *Segment, id uint64, h *Handle) (*Handle, func()) {
		other, _ := s.OpenWrite(id)
		other.Close()
		return h, h.Close
	})
	later(t, "opened while another was open", func(s *Segment, id uint64, h *Handle) (*Handle, func()) {
		second, _ := s.OpenWrite(id)
		h.Close()
		return second, second.Close
	})
	later(t, "released", func(s *Segment, id uint64, h *Handle) (*Handle, func()) {
		if err := s.Release(id); err != nil {
			t.Fatal(err)
		}
		return h, h.Close
	})
}

func equalBytes(a, b []byte) bool { return string(a) == string(b) }
