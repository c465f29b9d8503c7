package ctl

import (
	"strings"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/testcluster"
)

// TestSeveralMasters: --master takes a comma-separated list (issue 15,
// HA); a master of the list that cannot be reached is passed over for the
// next, and a list where none answers fails within --timeout.
func TestSeveralMasters(t *testing.T) {
	c := testcluster.Start(t, testcluster.Options{})
	masters := deadAddr(t) + "," + c.MasterAddr()
	if code, _, stderr := runIn(t, masters, "hello", "put", "k", "-"); code != ExitOK {
		t.Fatalf("put with --master %s: exit %d, stderr %q", masters, code, stderr)
	}
	if code, out, stderr := run(t, masters, "get", "k"); code != ExitOK || out != "hello" {
		t.Fatalf("get with --master %s: exit %d, stdout %q, stderr %q", masters, code, out, stderr)
	}
	if code, out, stderr := run(t, masters, "status"); code != ExitOK || !strings.Contains(out, "leader=true") {
		t.Fatalf("status with --master %s: exit %d, stdout %q, stderr %q", masters, code, out, stderr)
	}

	down := deadAddr(t) + "," + deadAddr(t)
	start := time.Now()
	if code, _, stderr := run(t, down, "--timeout", "500ms", "status"); code != ExitError {
		t.Fatalf("status against two stopped masters: exit %d (stderr %q), want %d", code, stderr, ExitError)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("status against two stopped masters with --timeout 500ms took %v", took)
	}
}
