// Package client is Crescent's Go SDK: what an inference-engine connector or
// a cache layer embeds to store and fetch KV-cache objects.
//
// Metadata goes to the master (ObjectService); bytes go straight to the
// agents (DataService) named by the descriptors the master returns. A Put is
// PutStart → write every replica in parallel → PutEnd (or PutRevoke on any
// failure, so nothing is ever half-visible). A Get asks for the replica list
// (granting a read lease), reads the nearest replica, falls back to the next
// on error and verifies the object checksum (XXH3-64, see Checksum).
//
//	c, err := client.New(ctx, client.Config{Master: "localhost:50051"})
//	err = c.Put(ctx, "prefix/block-0", data, client.WithReplicas(2))
//	got, err := c.Get(ctx, "prefix/block-0")
//
// Single calls made concurrently from many goroutines (Get, GetInto, Exist,
// Put's PutStart and PutEnd) share batch RPCs: while a lookup of a kind is
// in flight (for PutStart and PutEnd, Config.CoalesceInFlight of them),
// further calls of that kind wait for it to return and leave together,
// each with its own answer and error; a lone call goes out at once
// (coalesce.go; Config.DisableCoalescing).
//
// With several masters (one leader, the others standbys: issue 15, HA),
// Config.Master lists them all, separated by commas; every master call goes
// to the leader, following the NOT_LEADER answers of standbys and failing
// over to the next master while a leader is elected, within the call's
// context:
//
//	c, err := client.New(ctx, client.Config{Master: "m1:50051,m2:50051,m3:50051"})
//
// A cluster with mTLS (issue 14) takes a client certificate; a tenant's
// certificate acts for that tenant only:
//
//	tc, err := client.TLSFromFiles("ca.pem", "tenant-A.pem", "tenant-A-key.pem")
//	c, err := client.New(ctx, client.Config{Master: "master:50051", Tenant: "A", TLS: tc})
//
// This package and pkg/kvevent are Crescent's public Go API: the only
// packages of the module meant to be imported by other modules (everything
// else is internal/).
package client

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/auth"
	"github.com/crescent-kv/crescent/internal/masterlist"
	"github.com/crescent-kv/crescent/internal/obs/tracing"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/xfer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// Errors usable with errors.Is. They match on the reason the master or agent
// returned, whatever the message.
var (
	ErrNotFound      error = &rpcerr.Error{Reason: masterv1.ErrorReason_ERROR_REASON_OBJECT_NOT_FOUND}
	ErrExists        error = &rpcerr.Error{Reason: masterv1.ErrorReason_ERROR_REASON_OBJECT_ALREADY_EXISTS}
	ErrLeased        error = &rpcerr.Error{Reason: masterv1.ErrorReason_ERROR_REASON_OBJECT_HAS_LEASE}
	ErrBusy          error = &rpcerr.Error{Reason: masterv1.ErrorReason_ERROR_REASON_OBJECT_BUSY}
	ErrNotReady      error = &rpcerr.Error{Reason: masterv1.ErrorReason_ERROR_REASON_REPLICA_IS_NOT_READY}
	ErrNoSpace       error = &rpcerr.Error{Reason: masterv1.ErrorReason_ERROR_REASON_NO_AVAILABLE_HANDLE}
	ErrQuotaExceeded error = &rpcerr.Error{Reason: masterv1.ErrorReason_ERROR_REASON_TENANT_QUOTA_EXCEEDED}
	ErrInvalid       error = &rpcerr.Error{Reason: masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS}
	ErrChecksum      error = &rpcerr.Error{Reason: masterv1.ErrorReason_ERROR_REASON_CHECKSUM_MISMATCH}
	// ErrTooLarge: the object exceeds the master's --max-object-size.
	ErrTooLarge error = &rpcerr.Error{Reason: masterv1.ErrorReason_ERROR_REASON_OBJECT_TOO_LARGE}
	// ErrPutExpired: the master dropped the put before its PutEnd (it
	// was preempted or timed out, or every replica's segment went away
	// mid-write), so its bytes are gone. Put and BatchPut start it again
	// once by themselves; this is the second attempt's answer.
	ErrPutExpired error = &rpcerr.Error{Reason: masterv1.ErrorReason_ERROR_REASON_PUT_EXPIRED}
	// ErrFewerReplicas: the object was stored, and is readable, but with
	// fewer replicas than the put asked for: a master failover cut the put
	// between sealing one replica and the next, and the new leader holds
	// only the sealed ones (issue 15). The put is not acknowledged as
	// asked; put it again with WithUpsert to restore the count.
	ErrFewerReplicas = errors.New("stored with fewer replicas than asked (a master failover cut the put)")
)

// Config configures a Client.
type Config struct {
	// Master is the master's host:port, or several separated by commas
	// ("m1:50051,m2:50051,m3:50051") when masters run as a leader and
	// standbys (issue 15, HA). Calls start at the first and stay with
	// whichever master answered last as the leader: a standby's NOT_LEADER
	// names the leader, which the client then uses (even an address not
	// listed here, as a leader may be reachable at an address the client was
	// not given; a bounded number of them); NOT_LEADER without a leader (an
	// election in progress), a master shutting down or one that cannot be
	// reached sends the call to the next address after a short backoff. All
	// of it happens within the call's context and FailoverTimeout.
	Master string
	// Tenant scopes every key; "" means "default". Use Client.Tenant to
	// address another tenant over the same connections.
	Tenant string
	// ClientID identifies this writer to the master (PutEnd/PutRevoke must
	// come from the same id). Random when empty.
	ClientID string
	// HostID is this machine's host id: replicas on it are read first.
	// Defaults to os.Hostname().
	HostID string
	// MaxConcurrency bounds parallel data transfers per call. Default 16.
	MaxConcurrency int
	// ChunkSize is the data-plane stream chunk. Default 1 MiB.
	ChunkSize int
	// SmallObject is the size up to which objects travel in unary
	// BatchWrite/BatchRead calls instead of streams. Default 256 KiB.
	SmallObject int
	// Attempts is how many times a transient failure is tried: an agent
	// the master could not reach (AGENT_UNAVAILABLE), or the only master
	// unreachable. A leader change is retried within FailoverTimeout
	// instead. Default 3.
	Attempts int
	// Backoff is the first retry delay, doubled per attempt with jitter
	// up to 500 ms (or Backoff, when larger). Default 50 ms.
	Backoff time.Duration
	// FailoverTimeout bounds how long one master call keeps looking for
	// the leader (NOT_LEADER without a leader, MASTER_RECOVERING,
	// MASTER_SHUTTING_DOWN, one of several masters unreachable) before it
	// returns the last error; the call's context bounds it too, and comes
	// first when it is shorter. Default 15 s.
	FailoverTimeout time.Duration
	// StallTimeout bounds each wait on an agent while bytes move: on the
	// bulk TCP path, sending a request with up to 4 MiB of its payload,
	// each further 4 MiB, waiting for the answer and reading each 4 MiB of
	// it; through shared memory, waiting for a grant or for a release's
	// answer. An agent that is stopped, hung or cut off (its kernel may
	// keep the connection open) then fails the transfer with UNAVAILABLE
	// AGENT_UNAVAILABLE, and a Get goes on to the object's next replica,
	// instead of waiting until the call's deadline, or for ever without
	// one. Default 5 s; negative turns the bound off. gRPC calls (to the
	// masters, and to DataService) are bounded by keepalive instead: a
	// connection whose peer has not answered a ping 5 s after it was sent,
	// following 10 s without traffic, fails its calls with UNAVAILABLE
	// (DialOptions may replace that with grpc.WithKeepaliveParams).
	StallTimeout time.Duration
	// DisableTransfer moves every byte through the agents' gRPC
	// DataService, ignoring the bulk transfer endpoints they advertise
	// (internal/xfer), which are otherwise preferred.
	DisableTransfer bool
	// DisableSealOnWrite stops a single Put from asking the agents to seal
	// its replicas at the end of their bulk write (seal receipts, issue 18
	// item 2): PutEnd then waits for the master's Seal round trip to the
	// agents, as before receipts. For A/B measurements and as an escape
	// hatch; the default (false) saves that round trip.
	DisableSealOnWrite bool
	// DisableSpares stops a single-replica Put from leasing spares (blank
	// reservations the master holds for the client's next puts of a size)
	// and writing into them without a PutStart (spare.go): every put then
	// makes its PutStart round trip, as before spares. For A/B
	// measurements and as an escape hatch. A client with
	// SharedMemorySockets leases none either (its puts keep the
	// shared-memory path).
	DisableSpares bool
	// SharedMemorySockets are the Unix sockets of the agents on this host
	// that share their memory segments (crescent-agent --shm-socket): their
	// replicas' bytes then move by memcpy through this process's mapping
	// of the segment instead of the bulk TCP path, which stays the
	// fallback (shm.go). Unused with DisableTransfer or BearerToken.
	SharedMemorySockets []string
	// DisableMappedReads makes every read through shared memory ask the
	// agent first (a request, its grant, a release), as before mapped
	// reads: the agent then holds the allocation open under the copy. By
	// default (false) a whole-object read of a replica in a mapped segment
	// is copied straight from the mapping at the master's offset and
	// checked against the object's checksum; one that does not match is
	// read again by request. For A/B measurements and as an escape hatch.
	DisableMappedReads bool
	// TLS, when set, secures every connection the client makes: the
	// master, the agents' DataService and their bulk transfer listeners.
	// Each connection uses a clone whose server name, unless the
	// configuration sets one, is the host it dials (TLSFromFiles builds one
	// that offers a client certificate and picks up replaced files). Nil
	// is plaintext.
	TLS *tls.Config
	// BearerToken, when set, is sent with every gRPC call ("authorization:
	// Bearer <token>") for a principal that holds no certificate. It
	// requires TLS. The bulk transfer protocol carries no token (its
	// listener knows callers by their certificate), so with a token the
	// bytes go through DataService, as with DisableTransfer.
	BearerToken string
	// DisableCoalescing sends every single call (Get, Exist, Put's
	// PutStart and PutEnd, the replica-list lookups) as its own RPC.
	// By default concurrent single calls of one kind share batch RPCs
	// while Config.CoalesceInFlight of them are in flight (a lone call
	// still goes out at once: coalesce.go).
	DisableCoalescing bool
	// DisableCallStream sends the coalesced lookups (Get's replica lists)
	// as unary BatchGetReplicaList calls. By default they go on one
	// long-lived ObjectService.CallStream per master, which costs less per
	// call; a lookup falls back to the unary call by itself when the
	// stream fails or the master does not have it (callstream.go).
	DisableCallStream bool
	// DisableLookupListener keeps the lookups on the call stream. By
	// default, when a master's CallStream names its lookup listener
	// (crescent-master --lookup-addr), the lookups (Get's replica lists,
	// Exist) go there, on pooled connections of the client's own: a
	// quarter of the hand-offs between goroutines, the same authorization;
	// any failure there sends them back to the stream (lookup.go). Unused
	// with BearerToken, DisableCallStream or DialOptions (no gRPC
	// interceptor sees a call on the listener).
	DisableLookupListener bool
	// CoalesceInFlight is how many RPCs of one kind of single call may be
	// in flight. A Get, Exist or replica-list lookup goes out on its own
	// only when none of its kind is in flight, a PutStart or PutEnd while
	// fewer than CoalesceInFlight are; other calls wait and leave together
	// as one batch when one returns, or at once when they fill a batch and
	// fewer than CoalesceInFlight are in flight. Default 2.
	CoalesceInFlight int
	// DialOptions are added to every gRPC connection (interceptors...).
	// Transport credentials among them replace those TLS gives. Every
	// connection is already traced with OpenTelemetry (spans to the global
	// TracerProvider, the W3C trace context sent to the servers): an
	// otelgrpc handler here would make each call's span twice.
	DialOptions []grpc.DialOption
}

// TLSFromFiles returns a client TLS configuration for Config.TLS: the CA
// bundle ca verifies the servers, and the certificate chain cert with its
// key key, when given (both or neither), is offered to them. The files are
// read now (an error if missing or bad) and read again when they change on
// disk, looked at no more than once a second: new connections use the
// replaced certificates, open ones keep theirs. Without cert and key the
// client authenticates with Config.BearerToken, if at all.
func TLSFromFiles(ca, cert, key string) (*tls.Config, error) {
	src, err := auth.NewSource(auth.Files{CA: ca, Cert: cert, Key: key}, nil)
	if err != nil {
		return nil, fmt.Errorf("client: %w", err)
	}
	return src.ClientTLS(""), nil
}

func (c *Config) defaults() {
	if c.Tenant == "" {
		c.Tenant = "default"
	}
	if c.ClientID == "" {
		var b [8]byte
		_, _ = rand.Read(b[:])
		c.ClientID = "client-" + hex.EncodeToString(b[:])
	}
	if c.HostID == "" {
		c.HostID, _ = os.Hostname()
	}
	if c.MaxConcurrency <= 0 {
		c.MaxConcurrency = 16
	}
	if c.ChunkSize <= 0 {
		c.ChunkSize = 1 << 20
	}
	if c.SmallObject <= 0 {
		c.SmallObject = 256 << 10
	}
	if c.Attempts <= 0 {
		c.Attempts = 3
	}
	if c.Backoff <= 0 {
		c.Backoff = 50 * time.Millisecond
	}
	if c.FailoverTimeout <= 0 {
		c.FailoverTimeout = 15 * time.Second
	}
	if c.CoalesceInFlight <= 0 {
		c.CoalesceInFlight = defaultCoalesceInFlight
	}
}

// shared is what every tenant view of a client shares.
type shared struct {
	cfg Config

	// spares are the spares leased to this client (spare.go).
	spares spareCache

	// masters routes every master call to the leader (masters.go).
	masters *masters

	mu     sync.Mutex // guards agents, closed
	agents map[string]*grpc.ClientConn
	closed bool

	// co merges concurrent single calls into batch RPCs (coalesce.go).
	co *coalescers

	// xfer pools connections to the agents' bulk transfer listeners; nil
	// with Config.DisableTransfer.
	xfer *xfer.Pool
	// shm are the clients of Config.SharedMemorySockets (shm.go).
	shm shmClients
}

// Client talks to one Crescent cluster. It is safe for concurrent use.
type Client struct {
	s      *shared
	tenant string
}

// maxMsg is the largest gRPC message either side sends (internal/server's limit).
const maxMsg = 256 << 20

// dialOpts are the options of a gRPC connection.
func (s *shared) dialOpts() []grpc.DialOption {
	creds := insecure.NewCredentials()
	if s.cfg.TLS != nil {
		creds = &tlsCreds{TransportCredentials: credentials.NewTLS(s.cfg.TLS), base: s.cfg.TLS}
	}
	opts := []grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		rpccodec.DialOption(),
		// Spans to the global TracerProvider, context to the servers.
		tracing.DialOption(),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMsg), grpc.MaxCallSendMsgSize(maxMsg)),
		// Large windows and buffers: bulk streams are bound by flow control
		// otherwise.
		grpc.WithInitialWindowSize(16 << 20),
		grpc.WithInitialConnWindowSize(64 << 20),
		grpc.WithReadBufferSize(1 << 20),
		grpc.WithWriteBufferSize(1 << 20),
		// A peer that stops answering — a master or agent stopped or hung,
		// a host cut off — keeps a TCP connection open while its kernel
		// runs: without pings, a call on it (a leader's, during a
		// failover) would wait until its deadline, or for ever.
		masterlist.Keepalive(),
	}
	if s.cfg.BearerToken != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(auth.BearerCredentials(s.cfg.BearerToken)))
	}
	return append(opts, s.cfg.DialOptions...)
}

// tlsCreds are gRPC's TLS credentials over xfer.ClientTLS(base, authority)
// for each handshake, so that one configuration verifies every server
// against the host it was dialled by (an IP address too).
type tlsCreds struct {
	credentials.TransportCredentials // Info, ServerHandshake
	base                             *tls.Config
}

func (c *tlsCreds) ClientHandshake(ctx context.Context, authority string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return credentials.NewTLS(xfer.ClientTLS(c.base, authority)).ClientHandshake(ctx, authority, conn)
}

func (c *tlsCreds) Clone() credentials.TransportCredentials {
	return &tlsCreds{TransportCredentials: c.TransportCredentials.Clone(), base: c.base}
}

// New returns a client for the master (or masters) at cfg.Master. It does
// not wait for a connection; the first call does (honouring its context).
func New(_ context.Context, cfg Config) (*Client, error) {
	addrs := splitMasters(cfg.Master)
	if len(addrs) == 0 {
		return nil, errors.New("client: Config.Master is required")
	}
	if cfg.BearerToken != "" && cfg.TLS == nil {
		return nil, errors.New("client: Config.BearerToken requires Config.TLS (a token is never sent in plaintext)")
	}
	cfg.defaults()
	s := &shared{cfg: cfg, agents: map[string]*grpc.ClientConn{}}
	s.masters = newMasters(&cfg, addrs, s.dialMaster)
	s.co = newCoalescers(s)
	// Dial the first master now (no I/O) so that a malformed address
	// fails here; the others are dialled when a call first needs them.
	if _, err := s.masters.conn(addrs[0]); err != nil {
		return nil, err
	}
	if !cfg.DisableTransfer && cfg.BearerToken == "" {
		s.xfer = xfer.NewPool(xfer.Config{MaxIdlePerEndpoint: cfg.MaxConcurrency, StallTimeout: cfg.StallTimeout, TLS: cfg.TLS})
		s.shm = newShmClients(&cfg)
	}
	return &Client{s: s, tenant: cfg.Tenant}, nil
}

// Tenant returns a view of c addressing another tenant; it shares c's
// connections (Close either one closes both).
func (c *Client) Tenant(tenant string) *Client {
	if tenant == "" {
		tenant = "default"
	}
	return &Client{s: c.s, tenant: tenant}
}

// TenantName is the tenant this client addresses.
func (c *Client) TenantName() string { return c.tenant }

// Close closes every connection. Idempotent.
func (c *Client) Close() error {
	// First the coalescers: their batches in flight end (they take s.mu
	// for agent connections), their waiters get errClosed.
	c.s.co.close()
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	if c.s.closed {
		return nil
	}
	c.s.closed = true
	errs := []error{c.s.masters.Close()}
	for _, cc := range c.s.agents {
		errs = append(errs, cc.Close())
	}
	if c.s.xfer != nil {
		errs = append(errs, c.s.xfer.Close(), c.s.shm.close())
	}
	return errors.Join(errs...)
}

// dialMaster returns a connection to the master at addr. Its reconnect
// backoff is capped at a second, and a connection attempt given up after
// 3 s, so that a master that comes back (or a leader elected on it) is
// reachable again soon, and a call is not held long by one that cannot be
// reached while others can answer.
func (s *shared) dialMaster(addr string) (*grpc.ClientConn, error) {
	opts := append([]grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
		Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
		MinConnectTimeout: 3 * time.Second,
	})}, s.dialOpts()...)
	cc, err := grpc.NewClient(addr, opts...)
	if err != nil {
		return nil, fmt.Errorf("client: dial master %s: %w", addr, err)
	}
	return cc, nil
}

// Objects is the raw ObjectService client, for what the SDK does not wrap.
// Its calls follow the leader as the SDK's own do (Config.Master), with
// the same retries.
func (c *Client) Objects() masterv1.ObjectServiceClient {
	return masterv1.NewObjectServiceClient(c.s.masters)
}

// Admin is the raw AdminService client; its calls follow the leader.
func (c *Client) Admin() masterv1.AdminServiceClient {
	return masterv1.NewAdminServiceClient(c.s.masters)
}

// Changes is the raw ChangeService client. Its streams find the leader when
// they are opened (up to their first response, see masters.NewStream); a
// stream that breaks later is opened again by calling the method again.
func (c *Client) Changes() masterv1.ChangeServiceClient {
	return masterv1.NewChangeServiceClient(c.s.masters)
}

// agent returns the pooled DataService client for an agent endpoint.
func (c *Client) agent(endpoint string) (agentv1.DataServiceClient, error) {
	cc, err := c.agentConn(endpoint)
	if err != nil {
		return nil, err
	}
	return agentv1.NewDataServiceClient(cc), nil
}

// agentConn returns the pooled connection to an agent endpoint.
func (c *Client) agentConn(endpoint string) (*grpc.ClientConn, error) {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	if c.s.closed {
		return nil, errors.New("client: closed")
	}
	cc, ok := c.s.agents[endpoint]
	if !ok {
		var err error
		cc, err = grpc.NewClient(endpoint, c.s.dialOpts()...)
		if err != nil {
			return nil, fmt.Errorf("client: dial agent %s: %w", endpoint, err)
		}
		c.s.agents[endpoint] = cc
	}
	return cc, nil
}

// call runs a master RPC through the client's masters (which retry it and
// follow the leader, masters.do) and returns its error as an *rpcerr.Error
// when it carries a status, so that errors.Is against the sentinels works.
func call[T any](c *Client, f func(masterv1.ObjectServiceClient) (T, error)) (T, error) {
	res, err := f(c.Objects())
	if err != nil {
		var zero T
		return zero, rpcerr.FromStatus(err)
	}
	return res, nil
}
