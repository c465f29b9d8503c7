package meta

import (
	"sync"

	"github.com/cespare/xxhash/v2"
)

// Read-frequency sketch (issue 17 item 3): a count-min sketch of reads of
// objects that have no memory replica, so that promotion can tell a key
// read often from one read once, in a fixed amount of memory whatever the
// number of keys.
const (
	// sketchRows is the number of hash rows; a key's count is the least of
	// its counters in them.
	sketchRows = 4
	// sketchWidth is the number of counters per row (a power of two).
	sketchWidth = 1 << 16
	// sketchWords is a row's 64-bit words: eight 8-bit counters each.
	sketchWords = sketchWidth / 8
	// SketchBytes is the sketch's fixed size: 4 rows × 64k counters of
	// one byte, 256 KiB.
	SketchBytes = sketchRows * sketchWidth
	// sketchMax is where a counter saturates.
	sketchMax = 0xff
	// halveMask keeps, after a word is shifted right by one, each byte's
	// seven low bits (the bit shifted in from the next byte goes).
	halveMask = 0x7f7f7f7f7f7f7f7f
)

// sketch is a count-min sketch with conservative update (only the counters
// at the key's current minimum are raised, which keeps the overestimate of
// colliding keys low) and periodic halving: every halveEvery counted reads
// every counter is halved, so counts decay and the sketch reflects recent
// reads (the TinyLFU "reset"). It is safe for concurrent use: one small
// mutex, held for one add (4 word reads and writes) or one halving (32k
// word operations).
type sketch struct {
	// mu guards rows and adds (a leaf lock: nothing is locked under it).
	mu   sync.Mutex
	rows [sketchRows][sketchWords]uint64
	// adds counts the reads added since the last halving.
	adds       int
	halveEvery int
	// halvings counts the halvings (for tests and diagnostics).
	halvings uint64
}

// newSketch returns an empty sketch halving every halveEvery adds (> 0).
func newSketch(halveEvery int) *sketch {
	return &sketch{halveEvery: halveEvery}
}

// sketchHash is the 64-bit hash a key is counted under: the tenant id's
// four bytes, then the key.
func sketchHash(tenant uint32, key string) uint64 {
	var d xxhash.Digest
	d.Reset()
	tb := [4]byte{byte(tenant), byte(tenant >> 8), byte(tenant >> 16), byte(tenant >> 24)}
	_, _ = d.Write(tb[:])
	_, _ = d.WriteString(key)
	return d.Sum64()
}

// slots returns the key's counter index in each row, derived from one
// 64-bit hash (Kirsch-Mitzenmacher: h1 + i·h2, h2 odd).
func slots(h uint64) [sketchRows]uint32 {
	h1, h2 := uint32(h), uint32(h>>32)|1
	var out [sketchRows]uint32
	for i := range out {
		out[i] = (h1 + uint32(i)*h2) & (sketchWidth - 1)
	}
	return out
}

func counter(w uint64, i uint32) uint64 { return (w >> ((i & 7) * 8)) & 0xff }

// add counts one read of the key with hash h and returns its estimated
// count including this read (at most sketchMax).
func (s *sketch) add(h uint64) int {
	sl := slots(h)
	s.mu.Lock()
	est := uint64(sketchMax)
	for r, i := range sl {
		est = min(est, counter(s.rows[r][i>>3], i))
	}
	if est < sketchMax {
		for r, i := range sl {
			if counter(s.rows[r][i>>3], i) == est {
				s.rows[r][i>>3] += 1 << ((i & 7) * 8)
			}
		}
		est++
	}
	s.adds++
	if s.adds >= s.halveEvery {
		s.halveLocked()
	}
	s.mu.Unlock()
	return int(est)
}

// estimate is the key's count without counting a read.
func (s *sketch) estimate(h uint64) int {
	sl := slots(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	est := uint64(sketchMax)
	for r, i := range sl {
		est = min(est, counter(s.rows[r][i>>3], i))
	}
	return int(est)
}

// halveLocked halves every counter (rounding down) and restarts the count
// of adds.
func (s *sketch) halveLocked() {
	for r := range s.rows {
		row := &s.rows[r]
		for w := range row {
			row[w] = (row[w] >> 1) & halveMask
		}
	}
	s.adds = 0
	s.halvings++
}
