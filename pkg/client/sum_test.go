package client

import (
	"testing"

	"github.com/crescent-kv/crescent/internal/checksum"
)

// TestSumAside: Put's checksum is the object's XXH3-64 whether it is
// computed at once (small objects) or beside PutStart (large ones).
func TestSumAside(t *testing.T) {
	for _, n := range []int{0, 1, asideSum - 1, asideSum, 1 << 20} {
		data := make([]byte, n)
		for i := range data {
			data[i] = byte(i*7 + i>>8)
		}
		s := sumAside(data)
		if (s.done != nil) != (n >= asideSum) {
			t.Errorf("%d bytes: hashed aside %v, want %v", n, s.done != nil, n >= asideSum)
		}
		want := checksum.Sum(data)
		if got := s.get(); got != want {
			t.Errorf("%d bytes: sum %x, want %x", n, got, want)
		}
		if got := s.get(); got != want { // a second get answers the same
			t.Errorf("%d bytes: second get %x, want %x", n, got, want)
		}
	}
}
