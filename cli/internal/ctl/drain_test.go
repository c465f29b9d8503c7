package ctl

import (
	"bytes"
	"fmt"
	"strings"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
)

// newFake starts the shared fake cluster (internal/testutil) that the
// SDK's tests use too.
func newFake(t *testing.T, cfg testutil.FakeConfig) *testutil.Fake {
	t.Helper()
	return testutil.NewFake(t, cfg)
}

func run(t *testing.T, addr string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = Main(t.Context(), append([]string{"--master", addr}, args...), strings.NewReader(""), &out, &errb)
	return code, out.String(), errb.String()
}

func TestDrainUndo(t *testing.T) {
	f := newFake(t, testutil.FakeConfig{})
	f.SetLifecycle("seg-1", masterv1.SegmentLifecycle_SEGMENT_LIFECYCLE_UNMOUNTING)
	addr := f.Addr()
	for _, tc := range []struct {
		args     []string
		code     int
		out, err string
	}{
		{[]string{"drain", "seg-0"}, ExitOK, "segment seg-0: DRAINED\n", ""},
		{[]string{"drain", "--undo", "seg-0"}, ExitOK, "segment seg-0: OK\n", ""},
		{[]string{"drain", "--undo", "seg-0"}, ExitOK, "segment seg-0: OK\n", ""},
		{[]string{"-o", "json", "drain", "--undo", "seg-0"}, ExitOK, `{"lifecycle":"OK","segment_id":"seg-0"}` + "\n", ""},
		{[]string{"drain", "--undo", "seg-1"}, ExitError, "", "SEGMENT_UNAVAILABLE"},
		{[]string{"drain", "seg-1"}, ExitError, "", "SEGMENT_UNAVAILABLE"},
		{[]string{"drain", "--undo", "nope"}, ExitError, "", "SEGMENT_NOT_FOUND"},
		{[]string{"drain", "nope"}, ExitError, "", "SEGMENT_NOT_FOUND"},
	} {
		code, out, errOut := run(t, addr, tc.args...)
		if code != tc.code || out != tc.out || !strings.Contains(errOut, tc.err) {
			t.Errorf("crescentctl %v: got exit %d, stdout %q, stderr %q; want %d, %q, stderr containing %q", tc.args, code, out, errOut, tc.code, tc.out, tc.err)
		}
	}
}

// TestRemovePrefixFollowsPages: the master answers a prefix removal in
// pages; crescentctl rm --prefix follows them and reports the total.
func TestRemovePrefixFollowsPages(t *testing.T) {
	f := newFake(t, testutil.FakeConfig{PageSize: 7})
	var items []client.Item
	for i := range 50 {
		items = append(items, client.Item{Key: fmt.Sprintf("p/%04d", i)}, client.Item{Key: fmt.Sprintf("q/%04d", i)})
	}
	seed(t, f, items...)
	code, out, errOut := run(t, f.Addr(), "-o", "json", "rm", "--prefix", "p/")
	if code != ExitOK || out != `{"removed":50,"skipped":0}`+"\n" {
		t.Fatalf("rm --prefix: exit %d, stdout %q, stderr %q; want 0 and 50 removed", code, out, errOut)
	}
	if calls, left := f.Calls("RemoveByPrefix"), len(f.Keys("default")); calls != 8 || left != 50 {
		t.Fatalf("master saw %d calls and kept %d keys, want 8 pages and the 50 q/ keys", calls, left)
	}
}

// seed stores items in the default tenant through the SDK.
func seed(t *testing.T, f *testutil.Fake, items ...client.Item) {
	t.Helper()
	c, err := client.New(t.Context(), client.Config{Master: f.Addr()})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i, err := range c.BatchPut(t.Context(), items) {
		if err != nil {
			t.Fatalf("seed %s: %v", items[i].Key, err)
		}
	}
}
