package ctl

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/crescent-kv/crescent/internal/testcluster"
)

// TestGetCorruptReplica: get -o FILE of an object with one corrupt replica
// writes the object (the SDK rewinds the file and reads the other
// replica); a get that fails — every replica corrupt, or no such key —
// leaves no file behind, since its bytes are not the object.
func TestGetCorruptReplica(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{})
	addr := c.MasterAddr()
	dir := t.TempDir()
	src := filepath.Join(dir, "in")
	data := bytes.Repeat([]byte("0123456789abcdef"), 40<<10) // 640 KiB: streamed
	if err := os.WriteFile(src, data, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"one", "both", "both-out"} {
		if code, _, errOut := run(t, addr, "put", "--replicas", "2", key, src); code != ExitOK {
			t.Fatalf("put %s: exit %d, stderr %q", key, code, errOut)
		}
	}
	// Replica 0 in the master's order: the one crescentctl, on none of
	// the cluster's hosts, reads first (the get failed with
	// CHECKSUM_MISMATCH before GetTo rewound files).
	c.Corrupt("default", "one", 0)
	// Every get of a corrupt replica asks its agent to verify it, which
	// drops it: each failing case reads its own object.
	for _, key := range []string{"both", "both-out"} {
		c.Corrupt("default", key, 0)
		c.Corrupt("default", key, 1)
	}

	dst := filepath.Join(dir, "out")
	if code, out, errOut := run(t, addr, "-o", dst, "get", "one"); code != ExitOK || out != "" {
		t.Fatalf("get -o file with one corrupt replica: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	if got, err := os.ReadFile(dst); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("get -o file with one corrupt replica wrote %d bytes (%v), want the %d of the object", len(got), err, len(data))
	}

	for _, tc := range []struct {
		key, want string
		code      int
	}{
		{"both", "CHECKSUM_MISMATCH", ExitError},
		{"missing", "OBJECT_NOT_FOUND", ExitNotFound},
	} {
		// dst exists (the previous get): the failed get truncated it, then
		// removed it.
		if code, _, errOut := run(t, addr, "-o", dst, "get", tc.key); code != tc.code || !strings.Contains(errOut, tc.want) {
			t.Fatalf("get -o file %s: exit %d, stderr %q; want exit %d and %s", tc.key, code, errOut, tc.code, tc.want)
		}
		if _, err := os.Stat(dst); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("after the failed get of %s, the destination file: %v; want it removed", tc.key, err)
		}
		if err := os.WriteFile(dst, []byte("stale"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// To stdout: the bytes went out, nothing to remove.
	if code, _, errOut := run(t, addr, "-o", "-", "get", "both-out"); code != ExitError || !strings.Contains(errOut, "CHECKSUM_MISMATCH") {
		t.Fatalf("get -o - of a corrupt object: exit %d, stderr %q", code, errOut)
	}
}
