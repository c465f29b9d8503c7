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
//   - A NOT_LEADER answer naming the master that gave it comes from a master
//     that won the election and is waiting out its predecessor's lease: the
//     caller stays and asks it again after NotLeaderPoll.
//   - Anything else (NOT_LEADER without a hint, during an election; a
//     transport failure; a session that ended) moves to the next address of
//     the list.
//   - The backoff grows by one step per round of the list, not per address,
//     so every address is tried at the short delay first. Once a master has
//     answered NOT_LEADER the masters are up and a leader serves within about
//     a lease TTL, so for the next ElectionPolls attempts the delay is at
//     most NotLeaderPoll (the agents then register with the new leader a
//     poll after it serves, not a grown backoff later: the failover time of
//     issue 15 is set by the slowest agent); after those, a NOT_LEADER caps
//     it at NotLeaderDelay. A working session resets all of it (Healthy).
//   - A master that stops answering while its connection stays open (its
//     process stopped or hung, a paused VM) is a transport failure too, once
//     keepalive notices it (Keepalive): without pings a call or stream on it
//     would wait for ever, and a caller would never move on to the leader
//     elected meanwhile.
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
	// NotLeaderPoll caps the delay while an election settles (jittered to
	// half to full); ElectionPolls is for how many attempts after a
	// NOT_LEADER answer: 40 polls, 6–8 s, cover a lease TTL of 5 s with
	// etcd's lease expiry check and the new leader's wait.
	NotLeaderPoll = 200 * time.Millisecond
	ElectionPolls = 40
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
	polls     int    // NotLeaderPoll delays given since the last healthy session
	electing  bool   // a NOT_LEADER answer came since the last healthy session
}

// NewPicker starts at list[0] (list non-empty: Split's result).
func NewPicker(list []string) *Picker { return &Picker{list: list, cur: list[0]} }

// Current is the address of the next attempt.
func (p *Picker) Current() string { return p.cur }

// Healthy resets the backoff after a session that worked (registered,
// delivered).
func (p *Picker) Healthy() { p.fails, p.polls, p.electing = 0, 0, false }

// Next moves on after a failure err and returns the delay before the next
// attempt and whether it follows a leader hint.
func (p *Picker) Next(err error, lo, hi time.Duration) (delay time.Duration, redirected bool) {
	hint, notLeader := rpcerr.LeaderHint(err)
	p.electing = p.electing || notLeader
	if notLeader && hint == p.cur {
		// Elected, not serving yet: ask it again shortly.
		p.redirects = 0
		return p.poll(retry.Delay(lo, hi, p.fails/len(p.list))), false
	}
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
	return p.poll(delay), false
}

// poll caps delay at NotLeaderPoll while an election settles.
func (p *Picker) poll(delay time.Duration) time.Duration {
	if !p.electing || p.polls >= ElectionPolls {
		return delay
	}
	p.polls++
	return min(delay, retry.Jitter(NotLeaderPoll))
}

// Stay returns the delay before trying the same master again, and grows
// the backoff.
func (p *Picker) Stay(lo, hi time.Duration) time.Duration {
	d := retry.Delay(lo, hi, p.fails/len(p.list))
	p.fails++
	return d
}
