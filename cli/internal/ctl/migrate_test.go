package ctl

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/crescent-kv/crescent/internal/testcluster"
)

// TestCopyMove runs crescentctl mv and cp against a real cluster: the
// object follows the command (mv leaves one replica on the target, cp adds
// one), the bytes stay readable, each key gets a line, and refusals and
// usage errors get their exit codes.
func TestCopyMove(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{})
	addr := c.MasterAddr()
	seg0, seg1 := segmentOf(t, c, "agent-0"), segmentOf(t, c, "agent-1")
	cl := c.Client(t)
	var key string
	for i := 0; key == "" && i < 64; i++ {
		k := fmt.Sprintf("m/%d", i)
		if err := cl.Put(t.Context(), k, []byte("move me")); err != nil {
			t.Fatalf("put %s: %v", k, err)
		}
		if info, err := cl.Stat(t.Context(), k); err == nil && info.Replicas[0].GetSegmentId() == seg0 {
			key = k
		}
	}
	if key == "" {
		t.Fatalf("no put of 64 landed on %s", seg0)
	}
	replicas := func() []string {
		info, err := cl.Stat(t.Context(), key)
		if err != nil {
			t.Fatalf("stat %s: %v", key, err)
		}
		var out []string
		for _, r := range info.Replicas {
			out = append(out, r.GetSegmentId())
		}
		slices.Sort(out)
		return out
	}
	for _, tc := range []struct {
		args     []string
		code     int
		out, err string
		after    []string
	}{
		{[]string{"mv", key, "--to-segment", seg1}, ExitOK, key + "\tmoved\t" + seg0 + " -> " + seg1, "", []string{seg1}},
		{[]string{"cp", key, "--to-segment", seg0}, ExitOK, key + "\tcopied\t" + seg1 + " -> " + seg0, "", []string{seg0, seg1}},
		{[]string{"cp", key, "m/missing", "--to-segment", seg0}, ExitError, key + "\tFAILED", "OBJECT_ALREADY_EXISTS", []string{seg0, seg1}},
		{[]string{"mv", key, "--to-segment", "nope"}, ExitError, "", "SEGMENT_NOT_FOUND", []string{seg0, seg1}},
		{[]string{"-o", "json", "cp", key, "--to-medium", "memory"}, ExitError, `"ok":false`, "OBJECT_ALREADY_EXISTS", []string{seg0, seg1}},
		{[]string{"cp", key}, ExitUsage, "", "exactly one of", nil},
		{[]string{"cp", key, "--to-segment", seg0, "--to-host", "h"}, ExitUsage, "", "exactly one of", nil},
		{[]string{"mv", key, "--to-medium", "tape"}, ExitUsage, "", "unknown medium", nil},
		{[]string{"mv", "--to-segment", seg0}, ExitUsage, "", "at least one KEY", nil},
	} {
		code, out, errOut := run(t, addr, tc.args...)
		if code != tc.code || !strings.Contains(out, tc.out) || !strings.Contains(errOut, tc.err) {
			t.Errorf("crescentctl %v: got exit %d, stdout %q, stderr %q; want %d, stdout containing %q, stderr containing %q",
				tc.args, code, out, errOut, tc.code, tc.out, tc.err)
		}
		if tc.after != nil {
			slices.Sort(tc.after)
			if got := replicas(); !slices.Equal(got, tc.after) {
				t.Fatalf("after %v: replicas on %v, want %v", tc.args, got, tc.after)
			}
		}
	}
	if got, err := cl.Get(t.Context(), key); err != nil || string(got) != "move me" {
		t.Fatalf("get %s: %q, %v", key, got, err)
	}
}
