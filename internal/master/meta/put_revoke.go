package meta

import (
	"context"
	"slices"
)

// PutRevokeSpec is one PutRevoke.
type PutRevokeSpec struct {
	Tenant, Key, ClientID string
}

// PutRevoke abandons one put; see BatchPutRevoke.
func (s *Store) PutRevoke(ctx context.Context, sp PutRevokeSpec) error {
	return s.BatchPutRevoke(ctx, []PutRevokeSpec{sp})[0]
}

// BatchPutRevoke abandons many puts: their replicas are removed (released
// at the agents) and their quota refunded. A revoked upsert leaves no
// object (its old replicas were removed at PutStart).
func (s *Store) BatchPutRevoke(ctx context.Context, specs []PutRevokeSpec) []error {
	res := make([]error, len(specs))
	items := s.locateAll(len(specs),
		func(i int) (*string, string) { return &specs[i].Tenant, specs[i].Key },
		func(i int, err error) {
			if res[i] = ValidateClientID(specs[i].ClientID); res[i] == nil {
				res[i] = s.notFoundOrExpired(err, specs[i].Tenant, specs[i].Key)
			}
		})
	items = slices.DeleteFunc(items, func(it located) bool {
		res[it.i] = ValidateClientID(specs[it.i].ClientID)
		return res[it.i] != nil
	})
	rel := &releases{}
	forShards(items, located.shardOf, func(sh int, group []located) {
		shd := &s.shards[sh]
		shd.mu.Lock()
		m := s.begin(shd, rel)
		for _, it := range group {
			sp := &specs[it.i]
			o := shd.getLocked(it.tenant, sp.Key)
			switch {
			case o == nil:
				res[it.i] = s.notFoundOrExpired(errNotFound(sp.Tenant, sp.Key), sp.Tenant, sp.Key)
			case o.put == nil:
				res[it.i] = errPutExpired(sp.Tenant, sp.Key)
			case o.put.client != sp.ClientID:
				res[it.i] = errIllegalClient(sp.Tenant, sp.Key)
			default:
				m.removeAll(o, true)
			}
		}
		m.commit()
		shd.mu.Unlock()
	})
	s.sendReleasesNow(ctx, rel)
	return res
}
