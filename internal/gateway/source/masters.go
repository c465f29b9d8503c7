package source

import (
	"fmt"

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

// Masters are the gateway's connections to its masters (masterlist.Conns).
type Masters = masterlist.Conns

// NewMasters returns the connection set of list (SplitMasters's result).
// It dials nothing (grpc.NewClient connects lazily).
func NewMasters(list []string, opts ...grpc.DialOption) (*Masters, error) {
	m, err := masterlist.NewConns(list, opts...)
	if err != nil {
		return nil, fmt.Errorf("source: %w", err)
	}
	return m, nil
}
