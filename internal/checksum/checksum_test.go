package checksum

import (
	"bytes"
	"testing"
)

// Known answers from the reference implementation (xxhsum -H3, and
// Python's xxhash.xxh3_64_intdigest), so a change of library or algorithm
// cannot pass unnoticed: the value is stored by agents and the master and
// computed by clients in other languages.
func TestKnownAnswers(t *testing.T) {
	for _, tc := range []struct {
		in   []byte
		want uint64
	}{
		{nil, 0x2d06800538d394c2},
		{[]byte("hello"), 0x9555e8555c62dcfd},
		{bytes.Repeat([]byte{0xab}, 1<<20), 0x71bc70786780ecc7},
	} {
		if got := Sum(tc.in); got != tc.want {
			t.Errorf("Sum(%d bytes) = %#x, want %#x", len(tc.in), got, tc.want)
		}
	}
}

// TestDigestMatchesSum: writing in pieces gives Sum of the whole, across
// the algorithm's internal block and stripe boundaries.
func TestDigestMatchesSum(t *testing.T) {
	b := make([]byte, 3<<20+17)
	for i := range b {
		b[i] = byte(i*7 + i>>9)
	}
	for _, piece := range []int{1, 63, 64, 240, 1024, 65536, 1 << 20} {
		d := New()
		for off := 0; off < len(b); off += piece {
			_, _ = d.Write(b[off:min(off+piece, len(b))])
		}
		if got, want := d.Sum64(), Sum(b); got != want {
			t.Fatalf("pieces of %d: %#x, want %#x", piece, got, want)
		}
	}
}
