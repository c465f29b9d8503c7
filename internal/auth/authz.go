package auth

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Rule says who may call a method.
type Rule struct {
	// Roles allowed; admin is NOT implicit: list it.
	Roles []Role
	// Tenant: request messages carry a tenant (GetTenant() string, or
	// repeated items that do, as in the Batch* requests); a RoleTenant caller
	// must name its own tenant in every one ("" means "default"); other roles
	// pass. A message with no tenant field is refused to a tenant caller.
	Tenant bool
	// Audit logs an "audit" slog line with principal, method and outcome.
	Audit bool
	// Any authenticated principal (data plane: the capability token is the
	// real check). Exclusive with Roles.
	Any bool
}

// Table is one server's authorization table. Key: full method
// "/pkg.Service/Method" or "/pkg.Service/*" (an exact entry wins).
type Table map[string]Rule

// Options configures an Authorizer.
type Options struct {
	// TrustDomain every certificate and token principal must be in.
	TrustDomain string
	// Tokens, optional, are the bearer tokens accepted.
	Tokens *Tokens
	// Table is the authorization table; a method not in it is denied.
	Table Table
	// Logger receives audit lines and debug lines for denials.
	Logger *slog.Logger
	// Disabled is plaintext mode: everything is allowed and every call runs
	// as InsecurePrincipal().
	Disabled bool
	// Public methods are allowed unauthenticated (grpc health, reflection);
	// "/pkg.Service/*" is accepted.
	Public []string
}

// Authorizer enforces one table in one interceptor pair (and the admin HTTP
// wrapper), default deny. Safe for concurrent use.
type Authorizer struct {
	td       string
	tokens   *Tokens
	table    Table
	public   map[string]bool
	lg       *slog.Logger
	disabled bool

	tenantFields sync.Map // protoreflect.FullName -> *tenantPaths
}

// NewAuthorizer validates o and builds the Authorizer.
func NewAuthorizer(o Options) (*Authorizer, error) {
	a := &Authorizer{td: o.TrustDomain, tokens: o.Tokens, table: make(Table, len(o.Table)), public: map[string]bool{}, lg: o.Logger, disabled: o.Disabled}
	if a.lg == nil {
		a.lg = slog.New(slog.DiscardHandler)
	}
	if !o.Disabled {
		if err := validTrustDomain(o.TrustDomain); err != nil {
			return nil, fmt.Errorf("auth: options: %w", err)
		}
	}
	for m, r := range o.Table {
		if err := validMethodKey(m); err != nil {
			return nil, err
		}
		switch {
		case r.Any && len(r.Roles) > 0:
			return nil, fmt.Errorf("auth: table %s: Any and Roles are exclusive", m)
		case !r.Any && len(r.Roles) == 0:
			return nil, fmt.Errorf("auth: table %s: allows nobody (no Roles, not Any)", m)
		}
		for _, role := range r.Roles {
			if !role.Valid() {
				return nil, fmt.Errorf("auth: table %s: unknown role %q", m, role)
			}
		}
		r.Roles = slices.Clone(r.Roles)
		a.table[m] = r
	}
	for _, m := range o.Public {
		if err := validMethodKey(m); err != nil {
			return nil, err
		}
		if _, ok := o.Table[m]; ok {
			return nil, fmt.Errorf("auth: %s is both public and in the table", m)
		}
		a.public[m] = true
	}
	return a, nil
}

// validMethodKey accepts "/pkg.Service/Method" and "/pkg.Service/*".
func validMethodKey(m string) error {
	svc, meth, ok := strings.Cut(strings.TrimPrefix(m, "/"), "/")
	if !strings.HasPrefix(m, "/") || !ok || svc == "" || meth == "" || strings.Contains(meth, "/") ||
		strings.Contains(svc, "*") || (meth != "*" && strings.Contains(meth, "*")) {
		return fmt.Errorf("auth: %q is not /pkg.Service/Method or /pkg.Service/*", m)
	}
	return nil
}

// lookup finds the rule of a full method: exact entry, then the service's
// wildcard.
func lookup[V any](t map[string]V, method string) (V, bool) {
	if v, ok := t[method]; ok {
		return v, true
	}
	if i := strings.LastIndexByte(method, '/'); i > 0 {
		v, ok := t[method[:i]+"/*"]
		return v, ok
	}
	var zero V
	return zero, false
}

// Authenticate is who the caller of a grpc call is: the verified client
// certificate first, then a bearer token (only over TLS). Errors are
// Unauthenticated with the reason.
func (a *Authorizer) Authenticate(ctx context.Context) (Principal, error) {
	if a.disabled {
		return InsecurePrincipal(), nil
	}
	var cs *tls.ConnectionState
	if pr, ok := peer.FromContext(ctx); ok {
		if info, ok := pr.AuthInfo.(credentials.TLSInfo); ok {
			cs = &info.State
		}
	}
	md, _ := metadata.FromIncomingContext(ctx)
	p, reason := a.identify(cs, md.Get("authorization"))
	if reason != "" {
		return Principal{}, status.Error(codes.Unauthenticated, "auth: "+reason)
	}
	return p, nil
}

// identify is Authenticate for a connection state (nil without TLS) and the
// authorization header values; it returns the principal or why there is none.
func (a *Authorizer) identify(cs *tls.ConnectionState, authz []string) (Principal, string) {
	if cs != nil && len(cs.PeerCertificates) > 0 {
		// A certificate was presented: it alone decides.
		return certIdentity(cs, a.td)
	}
	if len(authz) == 0 {
		if cs == nil {
			return Principal{}, "no TLS and no credentials"
		}
		return Principal{}, "no client certificate and no bearer token"
	}
	if cs == nil {
		return Principal{}, "bearer token over a connection without TLS"
	}
	if a.tokens == nil {
		return Principal{}, "bearer tokens are not accepted here"
	}
	if len(authz) > 1 {
		return Principal{}, "more than one authorization value"
	}
	scheme, tok, ok := strings.Cut(authz[0], " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return Principal{}, "authorization is not a bearer token"
	}
	p, ok := a.tokens.Lookup(tok)
	if !ok {
		return Principal{}, "unknown bearer token"
	}
	if p.TrustDomain != a.td {
		return Principal{}, fmt.Sprintf("token principal's trust domain %q is not %q", p.TrustDomain, a.td)
	}
	return p, ""
}

// decision is the outcome of admit for an allowed call.
type decision struct {
	p      Principal
	rule   Rule
	checks bool // tenant checks and audit apply (false when disabled or public)
}

// admit authenticates and authorizes a call to method and returns the
// context handlers see.
func (a *Authorizer) admit(ctx context.Context, method string) (context.Context, decision, error) {
	if a.disabled {
		return NewContext(ctx, InsecurePrincipal()), decision{p: InsecurePrincipal()}, nil
	}
	if _, ok := lookup(a.public, method); ok {
		var d decision
		if p, err := a.Authenticate(ctx); err == nil {
			ctx, d.p = NewContext(ctx, p), p
		}
		return ctx, d, nil
	}
	rule, inTable := lookup(a.table, method)
	p, err := a.Authenticate(ctx)
	if err != nil {
		a.logDenied(ctx, rule.Audit, Principal{}, method, codes.Unauthenticated, status.Convert(err).Message())
		return ctx, decision{}, err
	}
	switch {
	case !inTable:
		return ctx, decision{}, a.deny(ctx, false, p, method, "method is not in the authorization table")
	case !rule.Any && !slices.Contains(rule.Roles, p.Role):
		return ctx, decision{}, a.deny(ctx, rule.Audit, p, method, fmt.Sprintf("role %s is not allowed", p.Role))
	}
	return NewContext(ctx, p), decision{p: p, rule: rule, checks: true}, nil
}

// deny logs and builds a PermissionDenied naming principal and method.
func (a *Authorizer) deny(ctx context.Context, audit bool, p Principal, method, reason string) error {
	a.logDenied(ctx, audit, p, method, codes.PermissionDenied, reason)
	return status.Errorf(codes.PermissionDenied, "auth: %s may not call %s: %s", p, trunc(method), reason)
}

func (a *Authorizer) logDenied(ctx context.Context, audit bool, p Principal, method string, code codes.Code, reason string) {
	if audit {
		a.audit(ctx, p, method, "denied", code, reason)
		return
	}
	a.lg.LogAttrs(ctx, slog.LevelDebug, "request denied", slog.String("principal", p.String()),
		slog.String("method", trunc(method)), slog.String("code", code.String()), slog.String("reason", reason))
}

// audit writes the audit line.
func (a *Authorizer) audit(ctx context.Context, p Principal, method, outcome string, code codes.Code, reason string) {
	attrs := []slog.Attr{
		slog.String("principal", p.String()),
		slog.String("method", trunc(method)),
		slog.String("outcome", outcome),
		slog.String("code", code.String()),
	}
	if reason != "" {
		attrs = append(attrs, slog.String("reason", reason))
	}
	a.lg.LogAttrs(ctx, slog.LevelInfo, "audit", attrs...)
}

// auditResult audits a finished call.
func (a *Authorizer) auditResult(ctx context.Context, d decision, method string, err error) {
	if !d.checks || !d.rule.Audit {
		return
	}
	outcome := "ok"
	if err != nil {
		outcome = "failed"
	}
	a.audit(ctx, d.p, method, outcome, status.Code(err), "")
}

// checkTenant applies a Tenant rule to one request message.
func (a *Authorizer) checkTenant(ctx context.Context, d decision, method string, m any) error {
	if !d.checks || !d.rule.Tenant || d.p.Role != RoleTenant {
		return nil
	}
	if reason := a.tenantMismatch(m, NormalizeTenant(d.p.Name)); reason != "" {
		return a.deny(ctx, d.rule.Audit, d.p, method, reason)
	}
	return nil
}

// Unary is the unary server interceptor.
func (a *Authorizer) Unary() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		ctx, d, err := a.admit(ctx, info.FullMethod)
		if err != nil {
			return nil, err
		}
		if err := a.checkTenant(ctx, d, info.FullMethod, req); err != nil {
			return nil, err
		}
		resp, err := handler(ctx, req)
		a.auditResult(ctx, d, info.FullMethod, err)
		return resp, err
	}
}

// Stream is the stream server interceptor; a Tenant rule is checked on every
// received message.
func (a *Authorizer) Stream() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		ctx, d, err := a.admit(ss.Context(), info.FullMethod)
		if err != nil {
			return err
		}
		err = handler(srv, &authStream{ServerStream: ss, ctx: ctx, a: a, d: d, method: info.FullMethod})
		a.auditResult(ctx, d, info.FullMethod, err)
		return err
	}
}

type authStream struct {
	grpc.ServerStream
	ctx    context.Context
	a      *Authorizer
	d      decision
	method string
}

func (s *authStream) Context() context.Context { return s.ctx }

func (s *authStream) RecvMsg(m any) error {
	if err := s.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	return s.a.checkTenant(s.ctx, s.d, s.method, m)
}

// HTTP wraps an admin HTTP handler: the principal comes from r.TLS (a
// verified client certificate) or a bearer token over TLS; none is 401, a
// role not in roles is 403 (no roles: any authenticated principal). The
// handler sees the principal in r.Context().
func (a *Authorizer) HTTP(next http.Handler, roles ...Role) http.Handler {
	return a.httpHandler(next, false, roles)
}

// HTTPAudit is HTTP that also writes an audit line for every request
// (pprof, admin actions).
func (a *Authorizer) HTTPAudit(next http.Handler, roles ...Role) http.Handler {
	return a.httpHandler(next, true, roles)
}

func (a *Authorizer) httpHandler(next http.Handler, audit bool, roles []Role) http.Handler {
	roles = slices.Clone(roles)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if a.disabled {
			next.ServeHTTP(w, r.WithContext(NewContext(r.Context(), InsecurePrincipal())))
			return
		}
		what := "HTTP " + r.Method + " " + r.URL.Path
		p, reason := a.identify(r.TLS, r.Header.Values("Authorization"))
		if reason != "" {
			a.logDenied(r.Context(), audit, Principal{}, what, codes.Unauthenticated, reason)
			w.Header().Set("WWW-Authenticate", `Bearer realm="crescent"`)
			http.Error(w, "unauthenticated: "+reason, http.StatusUnauthorized)
			return
		}
		if len(roles) > 0 && !slices.Contains(roles, p.Role) {
			reason := fmt.Sprintf("role %s is not allowed", p.Role)
			a.logDenied(r.Context(), audit, p, what, codes.PermissionDenied, reason)
			http.Error(w, fmt.Sprintf("permission denied: %s: %s", p, reason), http.StatusForbidden)
			return
		}
		if audit {
			a.audit(r.Context(), p, what, "ok", codes.OK, "")
		}
		next.ServeHTTP(w, r.WithContext(NewContext(r.Context(), p)))
	})
}

// tenantPaths are the places of a message type that carry a tenant.
type tenantPaths struct {
	top  protoreflect.FieldDescriptor // the message's own string "tenant", or nil
	sub  []subTenant                  // message fields (singular or repeated) whose type has one
	none bool                         // no tenant anywhere
}

type subTenant struct {
	field, tenant protoreflect.FieldDescriptor
}

func tenantField(md protoreflect.MessageDescriptor) protoreflect.FieldDescriptor {
	fd := md.Fields().ByName("tenant")
	if fd == nil || fd.Kind() != protoreflect.StringKind || fd.IsList() || fd.IsMap() {
		return nil
	}
	return fd
}

func (a *Authorizer) pathsOf(md protoreflect.MessageDescriptor) *tenantPaths {
	if v, ok := a.tenantFields.Load(md.FullName()); ok {
		return v.(*tenantPaths)
	}
	tp := &tenantPaths{top: tenantField(md)}
	fields := md.Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if fd.Kind() != protoreflect.MessageKind || fd.IsMap() {
			continue
		}
		if t := tenantField(fd.Message()); t != nil {
			tp.sub = append(tp.sub, subTenant{field: fd, tenant: t})
		}
	}
	tp.none = tp.top == nil && len(tp.sub) == 0
	a.tenantFields.Store(md.FullName(), tp)
	return tp
}

const reasonNoTenant = "request carries no tenant"

// tenantMismatch returns why m may not be acted on by tenant want, or "".
func (a *Authorizer) tenantMismatch(m any, want string) string {
	pm, ok := m.(proto.Message)
	if !ok {
		if t, ok := m.(interface{ GetTenant() string }); ok {
			return mismatch(t.GetTenant(), want)
		}
		return reasonNoTenant
	}
	msg := pm.ProtoReflect()
	tp := a.pathsOf(msg.Descriptor())
	if tp.none {
		return reasonNoTenant
	}
	if tp.top != nil {
		if r := mismatch(msg.Get(tp.top).String(), want); r != "" {
			return r
		}
	}
	for _, st := range tp.sub {
		if st.field.IsList() {
			l := msg.Get(st.field).List()
			for i := range l.Len() {
				if r := mismatch(l.Get(i).Message().Get(st.tenant).String(), want); r != "" {
					return r
				}
			}
		} else if msg.Has(st.field) {
			if r := mismatch(msg.Get(st.field).Message().Get(st.tenant).String(), want); r != "" {
				return r
			}
		}
	}
	return ""
}

func mismatch(got, want string) string {
	if NormalizeTenant(got) == want {
		return ""
	}
	return fmt.Sprintf("request tenant %q is not the caller's tenant %q", trunc(got), want)
}
