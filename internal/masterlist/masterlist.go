// Package masterlist is how every caller of the master follows its leader
// among several masters (issue 15, HA): the agents' link and the gateway's
// change-stream source pick the next address with a Picker; pkg/client
// follows the same NOT_LEADER contract (rpcerr.LeaderHint) with its own
// per-call loop.
//
// The rules:
//
//   - A NOT_LEADER answer naming the leader sends the caller there at once,
//     even to an address not in its list (the list is where to start, the
//     leader's advertised address is where it is; with mTLS the caller still
//     verifies that the server is a master), at most MaxRedirects times in a
//     row without a backoff between, so two masters naming each other cannot
//     keep it spinning.
//   - Anything else (NOT_LEADER without a hint, during an election; a
//     transport failure; a session that ended) moves to the next address of
//     the list.
//   - The backoff grows by one step per round of the list, not per address,
//     so every address is tried at the short delay first; after a NOT_LEADER
//     it is at most NotLeaderDelay, since the answering master is up and an
//     election settles in about a second.
package masterlist

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/crescent-kv/crescent/internal/retry"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

const (
	// MaxMasters bounds the addresses of a master list.
	MaxMasters = 16
	// MaxRedirects bounds the leader hints followed in a row.
	MaxRedirects = 3
	// NotLeaderDelay caps the delay after a NOT_LEADER answer.
	NotLeaderDelay = time.Second
)

// Split splits a comma-separated master list, trimming spaces. It refuses
// an empty list, an empty entry and more than MaxMasters entries; entries
// are not otherwise checked (gRPC targets other than host:port, such as
// tests' bufconn, pass).
func Split(s string) ([]string, error) {
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

// SplitHostPorts is Split that also requires every entry to be host:port.
func SplitHostPorts(s string) ([]string, error) {
	list, err := Split(s)
	if err != nil {
		return nil, err
	}
	for _, a := range list {
		if _, port, err := net.SplitHostPort(a); err != nil || port == "" {
			return nil, fmt.Errorf("master address %q is not host:port", a)
		}
	}
	return list, nil
}

// Picker chooses the address of the next attempt. It is not safe for
// concurrent use: one reconnect loop owns it.
type Picker struct {
	list      []string
	idx       int    // the list entry cur is, or the last one tried before a hint
	cur       string // the address of the next attempt
	redirects int    // hints followed in a row, without a backoff between
	fails     int    // attempts failed since the last healthy session, hints not counted
}

// NewPicker starts at list[0] (list non-empty: Split's result).
func NewPicker(list []string) *Picker { return &Picker{list: list, cur: list[0]} }

// Current is the address of the next attempt.
func (p *Picker) Current() string { return p.cur }

// Healthy resets the backoff after a session that worked (registered,
// delivered).
func (p *Picker) Healthy() { p.fails = 0 }

// Next moves on after a failure err and returns the delay before the next
// attempt and whether it follows a leader hint.
func (p *Picker) Next(err error, lo, hi time.Duration) (delay time.Duration, redirected bool) {
	hint, notLeader := rpcerr.LeaderHint(err)
	if hint != "" && hint != p.cur && p.redirects < MaxRedirects {
		p.redirects++
		p.cur = hint
		if i := slices.Index(p.list, hint); i >= 0 {
			p.idx = i
		}
		return 0, true
	}
	delay = retry.Delay(lo, hi, p.fails/len(p.list))
	p.fails++
	p.redirects = 0
	p.idx = (p.idx + 1) % len(p.list)
	p.cur = p.list[p.idx]
	if notLeader {
		delay = min(delay, NotLeaderDelay)
	}
	return delay, false
}

// Stay returns the delay before trying the same master again, and grows
// the backoff.
func (p *Picker) Stay(lo, hi time.Duration) time.Duration {
	d := retry.Delay(lo, hi, p.fails/len(p.list))
	p.fails++
	return d
}
