package source

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/retry"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc"
)

// Following the leader among several masters (issue 15, HA). The agent's
// link (internal/agent/link, masters.go) follows the same rules:
//
//   - a NOT_LEADER answer naming the leader (ErrorInfo metadata "leader",
//     host:port) sends the source there at once, even to an address not in
//     the list (with mTLS the gateway still verifies that the server is a
//     master), at most maxRedirects times in a row without a backoff
//     between;
//   - any other failure (NOT_LEADER without a hint during an election, a
//     transport failure, a stream that ended) moves to the next address;
//   - the backoff grows by one step per round of the list, and is at most
//     notLeaderDelay after a NOT_LEADER.
//
// A new leader has a new epoch: the resumed Watch is refused with
// EPOCH_MISMATCH (or answers in the new epoch) and the source resyncs from
// its snapshot, publishing exactly the difference, through the same sink,
// so the publisher's sequence has no gap.
const (
	// MaxMasters bounds the addresses of the master list.
	MaxMasters = 16
	// maxRedirects bounds the leader hints followed in a row.
	maxRedirects = 3
	// notLeaderDelay caps the delay after a NOT_LEADER answer.
	notLeaderDelay = time.Second
	// leaderKey is the ErrorInfo metadata key of a NOT_LEADER's hint.
	leaderKey = "leader"
)

// SplitMasters splits a comma-separated master list, trimming spaces, and
// checks each entry is host:port. It refuses an empty list or entry and more
// than MaxMasters entries.
func SplitMasters(s string) ([]string, error) {
	if strings.TrimSpace(s) == "" {
		return nil, errors.New("master must be set")
	}
	parts := strings.Split(s, ",")
	if len(parts) > MaxMasters {
		return nil, fmt.Errorf("%d master addresses, at most %d", len(parts), MaxMasters)
	}
	out := make([]string, 0, len(parts))
	for _, p := range parts {
		p = strings.TrimSpace(p)
		if _, port, err := net.SplitHostPort(p); err != nil || port == "" {
			return nil, fmt.Errorf("master address %q is not host:port", p)
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

// picker chooses the address of the next attempt. Only Run uses it.
type picker struct {
	list      []string
	idx       int    // the list entry cur is, or the last one tried before a hint
	cur       string // the address of the next attempt
	redirects int    // hints followed in a row, without a backoff between
	fails     int    // attempts failed since the last healthy session, hints not counted
}

func newPicker(list []string) *picker { return &picker{list: list, cur: list[0]} }

// healthy resets the backoff after a session that delivered.
func (p *picker) healthy() { p.fails = 0 }

// next moves on after a failure and returns the delay before the next
// attempt and whether it follows a leader hint.
func (p *picker) next(err error, lo, hi time.Duration) (delay time.Duration, redirected bool) {
	hint, notLeader := leaderHint(err)
	if hint != "" && hint != p.cur && p.redirects < maxRedirects {
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
		delay = min(delay, notLeaderDelay)
	}
	return delay, false
}

// stay returns the delay before trying the same master again, and grows
// the backoff.
func (p *picker) stay(lo, hi time.Duration) time.Duration {
	d := retry.Delay(lo, hi, p.fails/len(p.list))
	p.fails++
	return d
}

// Masters are the gateway's connections to its masters: one ClientConn per
// address of the list, made on first use, and one more for the last leader
// hint outside the list (replaced by the next such hint), so at most
// MaxMasters+1.
type Masters struct {
	list []string
	opts []grpc.DialOption

	// mu guards conns, extra and closed.
	mu     sync.Mutex
	conns  map[string]*grpc.ClientConn
	extra  string // the address outside the list with a conn, if any
	closed bool
}

// NewMasters returns the connection set of list (SplitMasters's result,
// non-empty). It dials nothing (grpc.NewClient connects lazily).
func NewMasters(list []string, opts ...grpc.DialOption) (*Masters, error) {
	if len(list) == 0 || len(list) > MaxMasters {
		return nil, fmt.Errorf("source: %d master addresses, want 1 to %d", len(list), MaxMasters)
	}
	return &Masters{list: slices.Clone(list), opts: opts, conns: map[string]*grpc.ClientConn{}}, nil
}

// client returns the ChangeService of addr.
func (m *Masters) client(addr string) (masterv1.ChangeServiceClient, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, errors.New("source: master connections closed")
	}
	if cc, ok := m.conns[addr]; ok {
		return masterv1.NewChangeServiceClient(cc), nil
	}
	inList := slices.Contains(m.list, addr)
	if !inList && m.extra != "" {
		_ = m.conns[m.extra].Close()
		delete(m.conns, m.extra)
		m.extra = ""
	}
	cc, err := grpc.NewClient(addr, m.opts...)
	if err != nil {
		return nil, fmt.Errorf("master %s: %w", addr, err)
	}
	m.conns[addr] = cc
	if !inList {
		m.extra = addr
	}
	return masterv1.NewChangeServiceClient(cc), nil
}

// Close closes every connection. It is idempotent.
func (m *Masters) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	var errs []error
	for _, cc := range m.conns {
		errs = append(errs, cc.Close())
	}
	m.conns = nil
	return errors.Join(errs...)
}
