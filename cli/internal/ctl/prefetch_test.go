package ctl

import (
	"strings"
	"testing"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/testcluster"
	"github.com/crescent-kv/crescent/pkg/client"
)

// TestPrefetch runs crescentctl prefetch against a real cluster with a
// memory and a disk segment: --wait copies a disk-only object to memory
// and names the new replica, a second run says it is in memory, a run
// without --wait queues, a missing key fails the command (exit 3), and usage
// errors get their exit code.
func TestPrefetch(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{Agents: 1, AgentDisk: 16 << 20})
	addr := c.MasterAddr()
	cl := c.Client(t)
	for _, k := range []string{"p/a", "p/b"} {
		if err := cl.Put(t.Context(), k, []byte("prefetch me"), client.WithMedium(masterv1.Medium_MEDIUM_DISK)); err != nil {
			t.Fatalf("put %s: %v", k, err)
		}
	}
	var mem string
	for _, sg := range c.Master().Registry.Segments() {
		if sg.Medium == masterv1.Medium_MEDIUM_MEMORY {
			mem = sg.ID
		}
	}
	for _, tc := range []struct {
		args     []string
		code     int
		out, err string
	}{
		{[]string{"prefetch", "p/a", "--wait"}, ExitOK, "p/a\tcopied\t-> " + mem, ""},
		{[]string{"prefetch", "p/a"}, ExitOK, "p/a\tin memory", ""},
		{[]string{"prefetch", "p/b"}, ExitOK, "p/b\tqueued", ""},
		{[]string{"-o", "json", "prefetch", "p/a", "p/missing", "--wait"}, ExitNotFound, `"state":"in memory"`, "OBJECT_NOT_FOUND"},
		{[]string{"prefetch"}, ExitUsage, "", "at least one KEY"},
		{[]string{"prefetch", "p/a", "p/a"}, ExitError, "", "INVALID_PARAMS"},
	} {
		code, out, errOut := run(t, addr, tc.args...)
		if code != tc.code || !strings.Contains(out, tc.out) || !strings.Contains(errOut, tc.err) {
			t.Errorf("crescentctl %v: got exit %d, stdout %q, stderr %q; want %d, stdout containing %q, stderr containing %q",
				tc.args, code, out, errOut, tc.code, tc.out, tc.err)
		}
	}
	if got, err := cl.Get(t.Context(), "p/a"); err != nil || string(got) != "prefetch me" {
		t.Fatalf("get p/a: %q, %v", got, err)
	}
}
