package ha

import (
	"context"
	"errors"
	"fmt"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Unsettled segments: removals a failover must not undo.
//
// A leader removes an object from its metadata, then frees its
// allocations at the agents. An allocation it could not free (the agent
// unreachable or refusing: the release is owed) or could not even find
// (its segment detached: the removal is a tombstone, see
// internal/master/meta/tombstone.go) stays in the agent's table, and the
// standbys, which follow the agents' tables, still hold it. Without a
// record a new leader would serve those objects again. So before a leader
// acknowledges a removal that left something owed or tombstoned, it
// records the segment in etcd (Prefix+"unsettled/"+segment id), and
// removes the record once nothing is owed on the segment and it is no
// longer detached. A new leader reads the records before it serves and
// trusts nothing sealed on those segments before its term
// (meta.Store.Distrust).

// UnsettledSegment is one record: a segment that may hold allocations of
// objects an earlier leader removed.
type UnsettledSegment struct {
	ID     string // segment id
	Agent  string // its agent
	Memory bool   // a memory segment (forgotten when its agent registers without it)
}

// DefaultMaxUnsettled bounds the records a new leader reads: far past any
// cluster's segments.
const DefaultMaxUnsettled = 1 << 16

// maxTxnOps is etcd's default --max-txn-ops: the operations of one
// transaction.
const maxTxnOps = 128

// maxRecordID bounds a segment or agent id in a record (the master's own
// bound on ids, session.maxIDLen).
const maxRecordID = 256

func (e *Elector) unsettledPrefix() string { return e.cfg.Prefix + "unsettled/" }

// encodeUnsettled is a record's value: "m " or "d " (memory or disk), then
// the agent id.
func encodeUnsettled(s UnsettledSegment) string {
	if s.Memory {
		return "m " + s.Agent
	}
	return "d " + s.Agent
}

// parseUnsettled decodes the record of segment id (the key's suffix).
func parseUnsettled(id string, value []byte) (UnsettledSegment, error) {
	v := string(value)
	switch {
	case id == "" || len(id) > maxRecordID:
		return UnsettledSegment{}, fmt.Errorf("segment id of %d bytes (1 to %d)", len(id), maxRecordID)
	case len(v) < 3 || v[1] != ' ' || (v[0] != 'm' && v[0] != 'd'):
		return UnsettledSegment{}, fmt.Errorf("segment %.64q: value %.64q is not \"m <agent>\" or \"d <agent>\"", id, v)
	case len(v)-2 > maxRecordID:
		return UnsettledSegment{}, fmt.Errorf("segment %.64q: agent id of %d bytes (at most %d)", id, len(v)-2, maxRecordID)
	}
	return UnsettledSegment{ID: id, Agent: v[2:], Memory: v[0] == 'm'}, nil
}

// Unsettled lists the segments earlier leaders (or this one) recorded as
// unsettled. A list past DefaultMaxUnsettled, or a record that does not
// decode, fails the read: a leader that cannot know them must not serve.
func (t *Term) Unsettled(ctx context.Context) ([]UnsettledSegment, error) {
	e := t.e
	p := e.unsettledPrefix()
	resp, err := e.cli.Get(ctx, p, clientv3.WithPrefix(), clientv3.WithLimit(DefaultMaxUnsettled))
	if err != nil {
		return nil, fmt.Errorf("ha: list unsettled segments: %w", err)
	}
	if resp.More {
		return nil, fmt.Errorf("ha: list unsettled segments: more than %d recorded under %s", DefaultMaxUnsettled, p)
	}
	out := make([]UnsettledSegment, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		s, err := parseUnsettled(strings.TrimPrefix(string(kv.Key), p), kv.Value)
		if err != nil {
			return nil, fmt.Errorf("ha: unsettled segment record: %w", err)
		}
		out = append(out, s)
	}
	return out, nil
}

// SetUnsettled records the segments put as unsettled and removes the
// records of del, only while this term holds the election key, in
// transactions of at most etcd's default operations each.
func (t *Term) SetUnsettled(ctx context.Context, put []UnsettledSegment, del []string) error {
	e := t.e
	p := e.unsettledPrefix()
	ops := make([]clientv3.Op, 0, len(put)+len(del))
	for _, s := range put {
		if s.ID == "" || len(s.ID) > maxRecordID || len(s.Agent) > maxRecordID {
			return fmt.Errorf("ha: unsettled segment %.64q of agent %.64q: ids are 1 to %d bytes", s.ID, s.Agent, maxRecordID)
		}
		ops = append(ops, clientv3.OpPut(p+s.ID, encodeUnsettled(s)))
	}
	for _, id := range del {
		ops = append(ops, clientv3.OpDelete(p+id))
	}
	for len(ops) > 0 {
		n := min(len(ops), maxTxnOps)
		tr, err := e.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(t.election.Key()), "=", t.election.Rev())).Then(ops[:n]...).Commit()
		if err != nil {
			return fmt.Errorf("ha: record unsettled segments: %w", err)
		}
		if !tr.Succeeded {
			return errors.New("ha: record unsettled segments: no longer the leader")
		}
		ops = ops[n:]
	}
	return nil
}
