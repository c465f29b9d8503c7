package prefault

import (
	"bytes"
	"testing"
)

func TestBufferKeepsContents(t *testing.T) {
	b := make([]byte, 3<<20)
	for i := range b {
		b[i] = byte(i * 7)
	}
	want := bytes.Clone(b)
	Buffer(b[:0])     // the whole backing array
	Buffer(b[1:1000]) // unaligned start and end, capacity to the end
	Buffer(b[5:5])
	Buffer(nil)
	Buffer(make([]byte, 10)) // below minBytes: nothing
	if !bytes.Equal(b, want) {
		t.Fatal("Buffer changed the contents")
	}
}
