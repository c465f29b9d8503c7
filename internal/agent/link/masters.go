package link

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/retry"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// Following the leader among several masters (issue 15, HA).
//
// Config.MasterAddr is a comma-separated list. The link connects to one
// address at a time. A master that is not the leader answers every RPC with
// UNAVAILABLE NOT_LEADER and, when it knows one, the leader's address in the
// ErrorInfo metadata key "leader". The link then:
//
//   - follows the hint at once, even to an address not in the list (the
//     list is where to start, the leader's advertised address is where it
//     is; with mTLS the agent still verifies that the server is a master),
//     at most maxRedirects times in a row without a backoff between, so
//     two masters that name each other cannot keep it spinning;
//   - otherwise (NOT_LEADER without a hint, during an election; a
//     transport failure; any other end of the session) tries the next
//     address of the list.
//
// The reconnect backoff grows by one step per round of the list, not per
// address, so every address is tried at the short delay first; after a
// NOT_LEADER it is at most notLeaderDelay, since the answering master is up
// and an election takes about a second to settle.
const (
	// MaxMasters bounds the addresses of MasterAddr.
	MaxMasters = 16
	// maxRedirects bounds the leader hints followed in a row.
	maxRedirects = 3
	// notLeaderDelay caps the delay after a NOT_LEADER answer.
	notLeaderDelay = time.Second
	// leaderKey is the ErrorInfo metadata key of a NOT_LEADER's hint.
	leaderKey = "leader"
)

// SplitMasters splits a comma-separated master list, trimming spaces. It
// refuses an empty list, an empty entry and more than MaxMasters entries;
// entries are not otherwise checked (the link also takes gRPC targets, as
// tests dial bufconn).
func SplitMasters(s string) ([]string, error) {
	if strings.TrimSpace(s) == "" {
		return nil, errors.New("master address is required")
	}
	parts := strings.Split(s, ",")
	if len(parts) > MaxMasters {
		return nil, fmt.Errorf("%d master addresses, at most %d", len(parts), MaxMasters)
	}
	out := make([]string, 0, len(parts))
	for i, p := range parts {
		p = strings.TrimSpace(p)
		if p == "" {
			return nil, fmt.Errorf("master address %d of %q is empty", i+1, s)
		}
		out = append(out, p)
	}
	return out, nil
}

// leaderHint reports whether err is a NOT_LEADER answer and the leader it
// names ("" when none is known or the hint is not host:port).
func leaderHint(err error) (hint string, notLeader bool) {
	if rpcerr.Reason(err) != rpcerr.ReasonName(masterv1.ErrorReason_ERROR_REASON_NOT_LEADER) {
		return "", false
	}
	hint = rpcerr.Metadata(err)[leaderKey]
	if host, port, err := net.SplitHostPort(hint); err != nil || host == "" || port == "" {
		return "", true
	}
	return hint, true
}

// masters picks the address of the next attempt. Only Run's loop uses it.
type masters struct {
	list      []string
	idx       int    // the list entry cur is, or the last one tried before a hint
	cur       string // the address of the next attempt
	redirects int    // hints followed in a row, without a backoff between
	fails     int    // attempts failed since the last registration, hints not counted
}

func newMasters(list []string) *masters { return &masters{list: list, cur: list[0]} }

// registered resets the backoff after a session that registered.
func (m *masters) registered() { m.fails = 0 }

// next moves on after a session ended with err and returns the delay before
// the next attempt and whether it follows a leader hint.
func (m *masters) next(err error, base, hi time.Duration) (delay time.Duration, redirected bool) {
	hint, notLeader := leaderHint(err)
	if hint != "" && hint != m.cur && m.redirects < maxRedirects {
		m.redirects++
		m.cur = hint
		for i, a := range m.list {
			if a == hint {
				m.idx = i
			}
		}
		return 0, true
	}
	delay = retry.Delay(base, hi, m.fails/len(m.list))
	m.fails++
	m.redirects = 0
	m.idx = (m.idx + 1) % len(m.list)
	m.cur = m.list[m.idx]
	if notLeader {
		delay = min(delay, notLeaderDelay)
	}
	return delay, false
}
