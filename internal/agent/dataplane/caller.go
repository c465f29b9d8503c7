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
// authenticated as, for check: set from its verified client certificate
// when the listener speaks TLS (transferServer.authenticate; tenant
// principals only), "" on a plaintext listener, which authenticates no one.
func (c *transferConn) callerTenant() string { return c.tenant }
