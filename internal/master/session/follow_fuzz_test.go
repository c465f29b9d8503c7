package session

import (
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"google.golang.org/protobuf/proto"
)

// FuzzValidateDelta: a TableDelta decoded from a Follow stream's bytes is
// checked without a panic, and one accepted continues the position exactly,
// counts one change per allocation within MaxDeltaChanges, and names only
// the agent's segments.
func FuzzValidateDelta(f *testing.F) {
	seed, _ := proto.Marshal(&masterv1.TableDelta{FromVersion: 3, Version: 5,
		Sealed:   []*masterv1.Allocation{{SegmentId: "s0", AllocationId: 9, State: masterv1.AllocationState_ALLOCATION_STATE_SEALED, Key: "k"}},
		Released: []*masterv1.Allocation{{SegmentId: "s1", AllocationId: 2, Key: "j"}}})
	f.Add(seed, uint64(3))
	f.Add([]byte{}, uint64(0))
	segs := map[string]bool{"s0": true, "s1": true}
	f.Fuzz(func(t *testing.T, b []byte, at uint64) {
		var d masterv1.TableDelta
		if proto.Unmarshal(b, &d) != nil {
			return
		}
		if validateDelta(&d, at, segs) != nil {
			return
		}
		n := uint64(len(d.GetSealed()) + len(d.GetReleased()))
		if d.GetFromVersion() != at || d.GetVersion()-at != n || n > MaxDeltaChanges {
			t.Fatalf("accepted delta %d..%d of %d changes at %d", d.GetFromVersion(), d.GetVersion(), n, at)
		}
		for _, a := range append(d.GetSealed(), d.GetReleased()...) {
			if !segs[a.GetSegmentId()] || a.GetKey() == "" {
				t.Fatalf("accepted allocation %v", a)
			}
		}
	})
}
