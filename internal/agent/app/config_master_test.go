package app

import (
	"strings"
	"testing"
)

func TestValidateMasterList(t *testing.T) {
	for _, tc := range []struct {
		master string
		ok     bool
	}{
		{"127.0.0.1:50051", true},
		{"m1:50051, m2:50051,m3:50051", true},
		{"m1", false},
		{"m1:50051,", false},
		{"m1:50051,m2", false},
		{strings.Repeat("m:1,", 16) + "m:1", false},
	} {
		cfg := DefaultConfig()
		cfg.Master, cfg.HostID = tc.master, "h"
		err := cfg.Validate()
		if (err == nil) != tc.ok {
			t.Errorf("Validate with master %q = %v, want ok %v", tc.master, err, tc.ok)
		}
	}
}
