package source

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/masterlist"
	"google.golang.org/grpc"
)

// Following the leader among several masters (issue 15, HA): the rules
// are internal/masterlist's (Picker), shared with the agents' link. A new
// leader has a new epoch: the resumed Watch is refused with EPOCH_MISMATCH
// (or answers in the new epoch) and the source resyncs from its snapshot,
// publishing exactly the difference, through the same sink, so the
// publisher's sequence has no gap.

// SplitMasters splits the gateway's --master list (host:port entries).
func SplitMasters(s string) ([]string, error) { return masterlist.SplitHostPorts(s) }

// Masters are the gateway's connections to its masters: one ClientConn per
// address of the list, made on first use, and one more for the last leader
// hint outside the list (replaced by the next such hint), so at most
// masterlist.MaxMasters+1.
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
	if len(list) == 0 || len(list) > masterlist.MaxMasters {
		return nil, fmt.Errorf("source: %d master addresses, want 1 to %d", len(list), masterlist.MaxMasters)
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
