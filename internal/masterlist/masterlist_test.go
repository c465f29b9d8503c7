package masterlist

import (
	"slices"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func notLeader(leader string) error {
	e := rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_NOT_LEADER, "not the leader")
	if leader != "" {
		e.Metadata = map[string]string{rpcerr.LeaderKey: leader}
	}
	return rpcerr.Status(e)
}

func TestPickerNext(t *testing.T) {
	const base, hi = 100 * time.Millisecond, 5 * time.Second
	transport := status.Error(codes.Unavailable, "connection refused")
	type step struct {
		err      error
		want     string        // address of the next attempt
		redirect bool          // a hint was followed
		maxDelay time.Duration // upper bound of the delay
	}
	for _, tc := range []struct {
		name  string
		list  []string
		steps []step
	}{
		{"one address backs off per failure", []string{"a:1"}, []step{
			{transport, "a:1", false, base},
			{transport, "a:1", false, 2 * base},
			{transport, "a:1", false, 4 * base},
		}},
		{"rotation backs off per round", []string{"a:1", "b:1", "c:1"}, []step{
			{transport, "b:1", false, base},
			{transport, "c:1", false, base},
			{transport, "a:1", false, base},
			{transport, "b:1", false, 2 * base},
		}},
		{"hint followed at once, also outside the list", []string{"a:1", "b:1"}, []step{
			{notLeader("z:9"), "z:9", true, 0},
			{transport, "b:1", false, base},
			{notLeader("a:1"), "a:1", true, 0},
			{transport, "b:1", false, base},
		}},
		{"no hint or a bad hint rotates", []string{"a:1", "b:1"}, []step{
			{notLeader(""), "b:1", false, base},
			{notLeader("no-port"), "a:1", false, base},
			{notLeader(""), "b:1", false, NotLeaderPoll},
		}},
		{"a self hint stays: elected, not serving yet", []string{"a:1", "b:1"}, []step{
			{notLeader("a:1"), "a:1", false, base},
			{notLeader("a:1"), "a:1", false, base},
			{transport, "b:1", false, base},
		}},
		{"a dead leader's hint polls until the election settles", []string{"a:1", "b:1"}, []step{
			// a (a standby) still names the killed b; b refuses connections.
			{notLeader("b:1"), "b:1", true, 0},
			{transport, "a:1", false, NotLeaderPoll}, {notLeader("b:1"), "b:1", true, 0},
			{transport, "a:1", false, NotLeaderPoll}, {notLeader("b:1"), "b:1", true, 0},
			{transport, "a:1", false, NotLeaderPoll}, {notLeader("b:1"), "b:1", true, 0},
			{transport, "a:1", false, NotLeaderPoll}, {notLeader("b:1"), "b:1", true, 0},
			{transport, "a:1", false, NotLeaderPoll}, {notLeader("b:1"), "b:1", true, 0},
			{transport, "a:1", false, NotLeaderPoll},
			// a won: it names itself until it serves.
			{notLeader("a:1"), "a:1", false, NotLeaderPoll},
		}},
		{"hints in a row are bounded", []string{"a:1", "b:1"}, []step{
			{notLeader("b:1"), "b:1", true, 0},
			{notLeader("a:1"), "a:1", true, 0},
			{notLeader("b:1"), "b:1", true, 0},
			{notLeader("a:1"), "a:1", false, base}, // the fourth: back off, move on
			{notLeader("b:1"), "b:1", true, 0},
		}},
		{"NOT_LEADER caps the delay", []string{"a:1"}, []step{
			{transport, "a:1", false, base}, {transport, "a:1", false, 2 * base}, {transport, "a:1", false, 4 * base},
			{transport, "a:1", false, 8 * base}, {transport, "a:1", false, 16 * base},
			{notLeader(""), "a:1", false, NotLeaderDelay},
		}},
		{"polls are bounded", []string{"a:1"}, func() []step {
			var steps []step
			for range ElectionPolls {
				steps = append(steps, step{notLeader(""), "a:1", false, NotLeaderPoll})
			}
			return append(steps, step{notLeader(""), "a:1", false, NotLeaderDelay}, step{transport, "a:1", false, hi})
		}()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := NewPicker(tc.list)
			for i, s := range tc.steps {
				d, redirected := m.Next(s.err, base, hi)
				if m.Current() != s.want || redirected != s.redirect || d > s.maxDelay {
					t.Fatalf("step %d (%v): got %s, redirected %v, delay %v; want %s, %v, at most %v", i, s.err, m.Current(), redirected, d, s.want, s.redirect, s.maxDelay)
				}
			}
		})
	}
}

func TestSplit(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string
		ok   bool
	}{
		{"a:1", []string{"a:1"}, true},
		{" a:1 , b:2", []string{"a:1", "b:2"}, true},
		{"", nil, false},
		{"a:1,,b:2", nil, false},
		{"a:1,", nil, false},
		{"a:1,a:2,a:3,a:4,a:5,a:6,a:7,a:8,a:9,a:10,a:11,a:12,a:13,a:14,a:15,a:16,a:17", nil, false},
	} {
		got, err := Split(tc.in)
		if (err == nil) != tc.ok || (tc.ok && !slices.Equal(got, tc.want)) {
			t.Errorf("Split(%q) = %q, %v; want %q, ok %v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

func TestSplitHostPorts(t *testing.T) {
	for _, tc := range []struct {
		in string
		ok bool
	}{
		{"a:1", true}, {"a:1, b:2", true}, {"", false}, {"a", false}, {"a:1,", false}, {"a:", false},
	} {
		if _, err := SplitHostPorts(tc.in); (err == nil) != tc.ok {
			t.Errorf("SplitHostPorts(%q) = %v, want ok %v", tc.in, err, tc.ok)
		}
	}
}

// TestNotLeaderRoundTrip: a master's NOT_LEADER answer, through a gRPC
// status, gives its hint back; a bad or missing one is no hint.
func TestNotLeaderRoundTrip(t *testing.T) {
	for _, tc := range []struct{ leader, want string }{{"m:1", "m:1"}, {"", ""}, {"no-port", ""}} {
		hint, nl := rpcerr.LeaderHint(rpcerr.FromStatus(rpcerr.Status(rpcerr.NotLeader(tc.leader))))
		if !nl || hint != tc.want {
			t.Errorf("NotLeader(%q): hint %q, not-leader %v; want %q, true", tc.leader, hint, nl, tc.want)
		}
	}
	if _, nl := rpcerr.LeaderHint(status.Error(codes.Unavailable, "down")); nl {
		t.Error("a transport error read as NOT_LEADER")
	}
}
