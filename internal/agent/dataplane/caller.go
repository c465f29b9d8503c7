package dataplane

import (
	"context"

	"github.com/crescent-kv/crescent/internal/auth"
)

// callerTenant is the tenant a DataService caller authenticated as, for
// check: the principal's name when it is a tenant (normalized like the
// master normalizes the tenant it signs into tokens), "" for any other
// principal (an agent copying for a drain, an admin, a gateway) or when the
// server authenticates no one.
func callerTenant(ctx context.Context) string {
	p, ok := auth.FromContext(ctx)
	if !ok || p.Role != auth.RoleTenant {
		return ""
	}
	return auth.NormalizeTenant(p.Name)
}

// callerTenant is the tenant the bulk transfer connection's peer
// authenticated as, for check; "" while the transfer listener authenticates
// no one.
//
// TODO(issue 14, TLS on the transfer listener): return the tenant of the
// connection's verified client certificate (tenant principals only) once
// the listener speaks TLS; until then tokens on this path are checked for
// everything but the caller's tenant.
func (c *transferConn) callerTenant() string { return "" }
