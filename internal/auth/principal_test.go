package auth_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/master/meta"
)

func TestParseSPIFFE(t *testing.T) {
	long := func(n int) string { return strings.Repeat("a", n) }
	tests := []struct {
		name, uri string
		want      auth.Principal
		ok        bool
	}{
		{"agent", "spiffe://crescent.local/agent/host-1", auth.Principal{"crescent.local", auth.RoleAgent, "host-1"}, true},
		{"gateway", "spiffe://td/gateway/gw_1", auth.Principal{"td", auth.RoleGateway, "gw_1"}, true},
		{"tenant", "spiffe://td/tenant/A.b", auth.Principal{"td", auth.RoleTenant, "A.b"}, true},
		{"admin", "spiffe://td/admin/root", auth.Principal{"td", auth.RoleAdmin, "root"}, true},
		{"master host:port", "spiffe://td/master/10.0.0.1:7000", auth.Principal{"td", auth.RoleMaster, "10.0.0.1:7000"}, true},
		{"name 128", "spiffe://td/agent/" + long(128), auth.Principal{"td", auth.RoleAgent, long(128)}, true},
		{"td label 63", "spiffe://" + long(63) + "/agent/a", auth.Principal{long(63), auth.RoleAgent, "a"}, true},

		{"empty", "", auth.Principal{}, false},
		{"http scheme", "https://td/agent/a", auth.Principal{}, false},
		{"no path", "spiffe://td", auth.Principal{}, false},
		{"role only", "spiffe://td/agent", auth.Principal{}, false},
		{"empty name", "spiffe://td/agent/", auth.Principal{}, false},
		{"two name segments", "spiffe://td/agent/a/b", auth.Principal{}, false},
		{"unknown role", "spiffe://td/root/a", auth.Principal{}, false},
		{"role case", "spiffe://td/Agent/a", auth.Principal{}, false},
		{"empty td", "spiffe:///agent/a", auth.Principal{}, false},
		{"upper td", "spiffe://TD/agent/a", auth.Principal{}, false},
		{"td port", "spiffe://td:443/agent/a", auth.Principal{}, false},
		{"td userinfo", "spiffe://u@td/agent/a", auth.Principal{}, false},
		{"td empty label", "spiffe://a..b/agent/a", auth.Principal{}, false},
		{"td trailing dot", "spiffe://td./agent/a", auth.Principal{}, false},
		{"td label 64", "spiffe://" + long(64) + "/agent/a", auth.Principal{}, false},
		{"td 256", "spiffe://" + strings.Repeat(long(63)+".", 4)[:256] + "/agent/a", auth.Principal{}, false},
		{"name 129", "spiffe://td/agent/" + long(129), auth.Principal{}, false},
		{"dot name", "spiffe://td/agent/.", auth.Principal{}, false},
		{"dotdot name", "spiffe://td/agent/..", auth.Principal{}, false},
		{"percent", "spiffe://td/agent/a%2Fb", auth.Principal{}, false},
		{"query", "spiffe://td/agent/a?x=1", auth.Principal{}, false},
		{"fragment", "spiffe://td/agent/a#x", auth.Principal{}, false},
		{"space", "spiffe://td/agent/a b", auth.Principal{}, false},
		{"too long", "spiffe://td/agent/" + long(3000), auth.Principal{}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := auth.ParseSPIFFE(tt.uri)
			if (err == nil) != tt.ok {
				t.Fatalf("ParseSPIFFE(%q) err = %v, want ok=%v", tt.uri, err, tt.ok)
			}
			if err != nil {
				if !errors.Is(err, auth.ErrInvalidSPIFFE) {
					t.Errorf("err = %v, want ErrInvalidSPIFFE", err)
				}
				if len(err.Error()) > 300 {
					t.Errorf("error is %d bytes long: input echoed unbounded", len(err.Error()))
				}
				return
			}
			if got != tt.want {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
			if got.String() != tt.uri {
				t.Errorf("String() = %q, want %q", got.String(), tt.uri)
			}
		})
	}
}

func FuzzParseSPIFFE(f *testing.F) {
	for _, s := range []string{"spiffe://crescent.local/agent/host-1", "spiffe://td/tenant/default", "spiffe://td/master/h:1", "spiffe://a..b/x/y", "spiffe://td/agent/a/b", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p, err := auth.ParseSPIFFE(s)
		if err != nil {
			if len(err.Error()) > 400 {
				t.Fatalf("error is %d bytes", len(err.Error()))
			}
			return
		}
		// Strict: what parses is the canonical form of what it parsed to.
		if p.String() != s {
			t.Fatalf("String() = %q, input %q", p.String(), s)
		}
		if err := p.Validate(); err != nil {
			t.Fatalf("parsed %+v does not validate: %v", p, err)
		}
		if len(s) > auth.MaxURILen || len(p.Name) > auth.MaxNameLen || len(p.TrustDomain) > auth.MaxTrustDomainLen {
			t.Fatalf("limits not enforced: %q", s)
		}
	})
}

func TestPrincipalString(t *testing.T) {
	if got := (auth.Principal{}).String(); got != "" {
		t.Errorf("zero String() = %q", got)
	}
	if got := auth.InsecurePrincipal().String(); got != "admin/insecure" {
		t.Errorf("insecure String() = %q", got)
	}
	if !(auth.Principal{}).IsZero() || auth.InsecurePrincipal().IsZero() {
		t.Error("IsZero wrong")
	}
}

func TestContext(t *testing.T) {
	ctx := context.Background()
	if _, ok := auth.FromContext(ctx); ok {
		t.Fatal("empty context has a principal")
	}
	p := auth.Principal{TrustDomain: td, Role: auth.RoleTenant, Name: "a"}
	got, ok := auth.FromContext(auth.NewContext(ctx, p))
	if !ok || got != p {
		t.Fatalf("FromContext = %v, %v; want %v", got, ok, p)
	}
}

// The tenant rule is duplicated from meta (see DefaultTenant's comment);
// this keeps the two the same.
func TestDefaultTenantAgreesWithMeta(t *testing.T) {
	if auth.DefaultTenant != meta.DefaultTenant {
		t.Fatalf("auth.DefaultTenant = %q, meta.DefaultTenant = %q", auth.DefaultTenant, meta.DefaultTenant)
	}
	for _, s := range []string{"", "a", "default"} {
		if got, want := auth.NormalizeTenant(s), meta.NormalizeTenant(s); got != want {
			t.Errorf("NormalizeTenant(%q) = %q, meta says %q", s, got, want)
		}
	}
}
