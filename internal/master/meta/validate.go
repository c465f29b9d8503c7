package meta

import (
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/cluster"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// DefaultTenant is the tenant of requests that name none.
const DefaultTenant = "default"

// Limits enforced on input (the adapters validate against them too). Every
// string a request may leave in the master's memory is bounded here.
const (
	MaxKeyLen     = cluster.MaxKeyLen // key, and a RemoveByPrefix/ListObjects prefix
	MaxTenantLen  = cluster.MaxTenantLen
	MaxGroupLen   = 1024
	MaxReplicaNum = 16
	// MaxClientIDLen bounds PutStart's client_id (kept with the put until
	// it ends) and the client_id of PutEnd and PutRevoke.
	MaxClientIDLen = 256
	// MaxHostLen bounds client_host, prefer_local_host and each preferred
	// segment id (the agents' own ids are limited to 256 bytes too).
	MaxHostLen = 256
	// MaxRegexLen and MaxRegexInsts bound a RemoveByRegex pattern: its
	// length in bytes, and its compiled program (regexp/syntax
	// instructions). RE2 matching is linear in input × program, so the
	// program size bounds each key's cost.
	MaxRegexLen   = 1024
	MaxRegexInsts = 4096
	// DefaultScanBudget is Config.ScanBudget's default.
	DefaultScanBudget = 1 << 16
)

func errNotFound(tenant, key string) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND, "object %q/%q not found", tenant, key)
}

func errInvalid(format string, args ...any) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, format, args...)
}

func errInternal(format string, args ...any) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INTERNAL, format, args...)
}

// NormalizeTenant maps "" to DefaultTenant.
func NormalizeTenant(t string) string {
	if t == "" {
		return DefaultTenant
	}
	return t
}

// ValidateKey checks a tenant and key pair.
func ValidateKey(tenant, key string) error {
	if len(key) == 0 || len(key) > MaxKeyLen {
		return errInvalid("key must be 1..%d bytes, got %d", MaxKeyLen, len(key))
	}
	if len(tenant) > MaxTenantLen {
		return errInvalid("tenant must be at most %d bytes, got %d", MaxTenantLen, len(tenant))
	}
	return nil
}

// ValidateClientID checks a client id (empty is allowed).
func ValidateClientID(id string) error {
	if len(id) > MaxClientIDLen {
		return errInvalid("client_id must be at most %d bytes, got %d", MaxClientIDLen, len(id))
	}
	return nil
}

// validatePutStrings checks the strings of a PutStart that ValidateKey and
// the group check do not: client id, preferred host and segments.
func validatePutStrings(sp *PutSpec) error {
	if err := ValidateClientID(sp.ClientID); err != nil {
		return err
	}
	if len(sp.PreferLocalHost) > MaxHostLen {
		return errInvalid("prefer_local_host must be at most %d bytes, got %d", MaxHostLen, len(sp.PreferLocalHost))
	}
	for _, id := range sp.Preferred {
		if len(id) > MaxHostLen {
			return errInvalid("preferred segment ids must be at most %d bytes, got %d", MaxHostLen, len(id))
		}
	}
	return nil
}

// locate normalizes *tenant in place, validates the key and resolves the
// tenant's index and the key's shard. A tenant that never held anything
// answers OBJECT_NOT_FOUND: every read, end, revoke and remove starts here.
func (s *Store) locate(tenant *string, key string) (t uint32, shard int, err error) {
	*tenant = NormalizeTenant(*tenant)
	if err := ValidateKey(*tenant, key); err != nil {
		return 0, 0, err
	}
	t, ok := s.tenants.lookup(*tenant)
	if !ok {
		return 0, 0, errNotFound(*tenant, key)
	}
	return t, s.shardIndex(t, key), nil
}

// located is one spec of a batch call resolved to its tenant and shard.
type located struct {
	i, shard int
	tenant   uint32
}

func (l located) shardOf() int { return l.shard }

// locateAll resolves specs 0..n-1 of a batch (spec gives each one's tenant,
// normalized in place, and key); one that fails validation goes to fail
// and is left out.
func (s *Store) locateAll(n int, spec func(i int) (tenant *string, key string), fail func(i int, err error)) []located {
	out := make([]located, 0, n)
	for i := range n {
		tp, key := spec(i)
		t, shard, err := s.locate(tp, key)
		if err != nil {
			fail(i, err)
			continue
		}
		out = append(out, located{i: i, tenant: t, shard: shard})
	}
	return out
}
