package testutil

import (
	"os"
	"testing"
)

// FlipByte inverts the byte at off of the file at path, as a bad sector or
// a stray write would (the disk-verification tests corrupt a segment's data
// file with it while its agent is down).
func FlipByte(t testing.TB, path string, off uint64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, int64(off)); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0xff
	if _, err := f.WriteAt(b, int64(off)); err != nil {
		t.Fatal(err)
	}
}
