package app

import (
	"flag"
	"strings"
	"testing"

	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/config"
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

// TestFollowStandbysConfig: following standbys is on by default and turned
// off by --follow-standbys=false or CRESCENT_FOLLOW_STANDBYS; the table
// feed's size is bounded.
func TestFollowStandbysConfig(t *testing.T) {
	for _, tc := range []struct {
		name       string
		args       []string
		env        map[string]string
		wantFollow bool
		wantFeed   int
		ok         bool
	}{
		{name: "defaults", wantFollow: true, wantFeed: segment.DefaultFeedSize, ok: true},
		{name: "flag", args: []string{"--follow-standbys=false", "--table-feed-size=4096"}, wantFeed: 4096, ok: true},
		{name: "env", env: map[string]string{"CRESCENT_FOLLOW_STANDBYS": "false", "CRESCENT_TABLE_FEED_SIZE": "2048"}, wantFeed: 2048, ok: true},
		{name: "feed too small", args: []string{"--table-feed-size=16"}, wantFollow: true, wantFeed: 16},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			fs := flag.NewFlagSet("agent", flag.ContinueOnError)
			cfg.RegisterFlags(fs)
			if err := config.Load(fs, append([]string{"--master=m1:1,m2:1", "--host-id=h"}, tc.args...), func(k string) (string, bool) {
				v, ok := tc.env[k]
				return v, ok
			}); err != nil {
				t.Fatal(err)
			}
			if cfg.FollowStandbys != tc.wantFollow || cfg.TableFeedSize != tc.wantFeed {
				t.Fatalf("follow-standbys %v, table-feed-size %d; want %v, %d", cfg.FollowStandbys, cfg.TableFeedSize, tc.wantFollow, tc.wantFeed)
			}
			if err := cfg.Validate(); (err == nil) != tc.ok {
				t.Fatalf("Validate = %v, want ok %v", err, tc.ok)
			}
		})
	}
}
