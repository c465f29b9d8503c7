package client

import (
	"context"
	"fmt"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// maxMigrateKeys is the master's bound on one Copy or Move request
// (meta.MaxMigrateKeys); Copy and Move send larger key lists in several.
const maxMigrateKeys = 1024

// Target is where Copy and Move put the new replica: set exactly one of a
// segment, a host (a segment there of the source's medium) or a medium.
type Target struct {
	Segment string
	Host    string
	Medium  masterv1.Medium
}

func (t Target) proto() *masterv1.MigrationTarget {
	switch {
	case t.Segment != "" && t.Host == "" && t.Medium == 0:
		return &masterv1.MigrationTarget{Target: &masterv1.MigrationTarget_SegmentId{SegmentId: t.Segment}}
	case t.Host != "" && t.Segment == "" && t.Medium == 0:
		return &masterv1.MigrationTarget{Target: &masterv1.MigrationTarget_HostId{HostId: t.Host}}
	case t.Medium != 0 && t.Segment == "" && t.Host == "":
		return &masterv1.MigrationTarget{Target: &masterv1.MigrationTarget_Medium{Medium: t.Medium}}
	}
	return nil // the master refuses it: INVALID_PARAMS
}

// MigrateResult is one key's outcome of Copy or Move.
type MigrateResult struct {
	Key string
	// Err is the key's failure (ErrNotFound, ErrBusy, ...), nil on success.
	Err error
	// Replica is the new COMPLETE replica when Err is nil.
	Replica *masterv1.ReplicaDescriptor
	// Source is the segment the bytes came from (for Move, the removed one).
	Source string
}

// MigrateOption adjusts Copy and Move.
type MigrateOption func(*migrateOptions)

type migrateOptions struct {
	from  string
	admin bool
}

// FromSegment names the replica Move moves, by its segment (Copy ignores
// it); without it the master takes the object's first COMPLETE replica that
// is not on the target.
func FromSegment(id string) MigrateOption { return func(o *migrateOptions) { o.from = id } }

// AsAdmin sends the request through AdminService (CopyObjects,
// MoveObjects): for operators, audited, for the client's tenant whoever
// the caller is.
func AsAdmin() MigrateOption { return func(o *migrateOptions) { o.admin = true } }

// Copy adds a replica of each key on the target: the bytes go agent to
// agent, and the new replica is readable only once sealed. It returns one
// result per key, in order; the error is a whole request's failure (an
// invalid target, an unknown target segment, the master unreachable), and
// the keys not done by then have it as their Err too.
func (c *Client) Copy(ctx context.Context, keys []string, to Target, opts ...MigrateOption) ([]MigrateResult, error) {
	return c.migrate(ctx, keys, to, false, opts)
}

// Move is Copy followed by the removal of the source replica, once the new
// one is readable: the object stays readable throughout. A hard-pinned
// object is not moved (ErrBusy).
func (c *Client) Move(ctx context.Context, keys []string, to Target, opts ...MigrateOption) ([]MigrateResult, error) {
	return c.migrate(ctx, keys, to, true, opts)
}

func (c *Client) migrate(ctx context.Context, keys []string, to Target, move bool, opts []MigrateOption) ([]MigrateResult, error) {
	var o migrateOptions
	for _, f := range opts {
		f(&o)
	}
	verb := "copy"
	if move {
		verb = "move"
	}
	out := make([]MigrateResult, len(keys))
	for i, k := range keys {
		out[i].Key = k
	}
	tgt := to.proto()
	for lo := 0; lo < len(keys) || lo == 0; lo += maxMigrateKeys {
		hi := min(lo+maxMigrateKeys, len(keys))
		res, err := c.migrateOnce(ctx, keys[lo:hi], tgt, move, &o)
		if err == nil && len(res) != hi-lo {
			err = fmt.Errorf("master answered %d results for %d keys", len(res), hi-lo)
		}
		if err != nil {
			err = fmt.Errorf("%s: %w", verb, err)
			for i := lo; i < len(keys); i++ {
				out[i].Err = err
			}
			return out, err
		}
		for i, r := range res {
			m := &out[lo+i]
			m.Replica, m.Source = r.GetReplica(), r.GetSourceSegmentId()
			if e := rpcerr.FromItem(r.GetStatus()); e != nil {
				m.Err = fmt.Errorf("%s %q: %w", verb, m.Key, e)
			}
		}
		if hi == len(keys) {
			break
		}
	}
	return out, nil
}

func (c *Client) migrateOnce(ctx context.Context, keys []string, tgt *masterv1.MigrationTarget, move bool, o *migrateOptions) ([]*masterv1.MigrationResult, error) {
	var (
		res []*masterv1.MigrationResult
		err error
	)
	switch {
	case o.admin && move:
		var r *masterv1.MoveObjectsResponse
		r, err = c.Admin().MoveObjects(ctx, &masterv1.MoveObjectsRequest{Tenant: c.tenant, Keys: keys, Target: tgt, FromSegmentId: o.from})
		res = r.GetResults()
	case o.admin:
		var r *masterv1.CopyObjectsResponse
		r, err = c.Admin().CopyObjects(ctx, &masterv1.CopyObjectsRequest{Tenant: c.tenant, Keys: keys, Target: tgt})
		res = r.GetResults()
	case move:
		var r *masterv1.ObjectServiceMoveResponse
		r, err = c.Objects().Move(ctx, &masterv1.ObjectServiceMoveRequest{Tenant: c.tenant, Keys: keys, Target: tgt, FromSegmentId: o.from})
		res = r.GetResults()
	default:
		var r *masterv1.ObjectServiceCopyResponse
		r, err = c.Objects().Copy(ctx, &masterv1.ObjectServiceCopyRequest{Tenant: c.tenant, Keys: keys, Target: tgt})
		res = r.GetResults()
	}
	if err != nil {
		return nil, rpcerr.FromStatus(err)
	}
	return res, nil
}
