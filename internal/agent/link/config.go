package link

import (
	"crypto/tls"
	"errors"
	"fmt"
	"github.com/crescent-kv/crescent/internal/masterlist"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/xfer"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

// Config tunes the link. Zero fields take the defaults of DefaultConfig.
type Config struct {
	// MasterAddr is the master's gRPC address (host:port or a gRPC
	// target), or several, comma-separated, of which the link follows the
	// leader (masters.go; issue 15, HA).
	MasterAddr string
	AgentID    string
	HostID     string
	// DataEndpoint is host:port of this agent's DataService as clients dial it.
	DataEndpoint string
	// TransferEndpoint is host:port of this agent's bulk transfer listener
	// (internal/xfer) as clients dial it; empty when it is off.
	TransferEndpoint string
	Version          string
	// Creds secure the master connection and the connections to other
	// agents for Copy (issue 14: internal/auth's Source.ClientCredentials,
	// which offers the agent's certificate and verifies each server against
	// the host it dials). Nil is plaintext.
	Creds credentials.TransportCredentials

	// BackoffBase and BackoffMax bound the reconnect delay; each failed
	// attempt doubles it, with jitter; a session that registered resets it.
	BackoffBase time.Duration
	BackoffMax  time.Duration
	// SettingsTimeout bounds the wait for Settings after Register.
	SettingsTimeout time.Duration
	// ShutdownGrace is announced in Deregister and is how long the agent
	// keeps serving after the shutdown signal.
	ShutdownGrace time.Duration
	// CloseTimeout bounds the wait for the master to end the stream after
	// the agent closed its send side.
	CloseTimeout time.Duration
	// MaxInFlight bounds the commands handled concurrently.
	MaxInFlight int
	// SendQueue is the capacity of the outgoing queue.
	SendQueue int
	// ReservedGrace is used until Settings carry one.
	ReservedGrace time.Duration
	// KeepaliveTime and KeepaliveTimeout detect a dead master connection
	// (a blackholed network never errors a Recv on its own).
	KeepaliveTime    time.Duration
	KeepaliveTimeout time.Duration
	// CopyChunk is the message size of a Copy to another agent through
	// its DataService.
	CopyChunk int
	// CopyPeers bounds the target agents one batched Copy writes to at
	// once.
	CopyPeers int
	// CopyConnsPerPeer bounds the transfer requests in flight to one
	// target agent (each on its own connection).
	CopyConnsPerPeer int
	// CopyRequestBytes is the payload of one transfer request of a Copy:
	// small objects share a request up to it, larger ones travel in ranges
	// of it. At most xfer.MaxDrainBytes and CopyMaxBytes.
	CopyRequestBytes int
	// CopyMaxBytes bounds the bytes of all Copy transfer requests in
	// flight (and the buffers disk sources are read into).
	CopyMaxBytes int
	// CopyPeerTimeout bounds one transfer request (or one object through
	// DataService) to a target agent; a target that does not answer within
	// it fails the request's items with AGENT_UNAVAILABLE.
	CopyPeerTimeout time.Duration
	// FollowStandbys, with Deps.Feed and several master addresses, keeps
	// a Follow stream to every master of the list (follow.go): standbys
	// then hold the agent's table when elected, and the agent's next
	// Connect skips it. The agent's --follow-standbys sets it (true by
	// default there); the zero Config does not follow.
	FollowStandbys bool
	// FollowRetry is the wait before following again a master that
	// answered MASTER_IS_LEADER (it may lose the leadership later).
	FollowRetry time.Duration
}

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{
		BackoffBase:      250 * time.Millisecond,
		BackoffMax:       5 * time.Second,
		SettingsTimeout:  10 * time.Second,
		ShutdownGrace:    5 * time.Second,
		CloseTimeout:     2 * time.Second,
		MaxInFlight:      16,
		SendQueue:        256,
		ReservedGrace:    60 * time.Second,
		KeepaliveTime:    masterlist.KeepaliveTime, // as every client of the masters
		KeepaliveTimeout: masterlist.KeepaliveTimeout,
		CopyChunk:        1 << 20,
		CopyPeers:        8,
		CopyConnsPerPeer: 2,
		CopyRequestBytes: 4 << 20,
		CopyMaxBytes:     64 << 20,
		CopyPeerTimeout:  30 * time.Second,
		FollowRetry:      2 * time.Second,
	}
}

func (c Config) withDefaults() Config {
	d := DefaultConfig()
	dur := func(v *time.Duration, def time.Duration) {
		if *v == 0 {
			*v = def
		}
	}
	dur(&c.BackoffBase, d.BackoffBase)
	dur(&c.BackoffMax, d.BackoffMax)
	dur(&c.SettingsTimeout, d.SettingsTimeout)
	dur(&c.CloseTimeout, d.CloseTimeout)
	dur(&c.ReservedGrace, d.ReservedGrace)
	dur(&c.KeepaliveTime, d.KeepaliveTime)
	dur(&c.KeepaliveTimeout, d.KeepaliveTimeout)
	dur(&c.FollowRetry, d.FollowRetry)
	if c.ShutdownGrace < 0 {
		c.ShutdownGrace = 0
	}
	if c.MaxInFlight <= 0 {
		c.MaxInFlight = d.MaxInFlight
	}
	if c.SendQueue <= 0 {
		c.SendQueue = d.SendQueue
	}
	if c.CopyChunk <= 0 {
		c.CopyChunk = d.CopyChunk
	}
	for _, v := range []struct {
		p   *int
		def int
	}{
		{&c.CopyPeers, d.CopyPeers}, {&c.CopyConnsPerPeer, d.CopyConnsPerPeer},
		{&c.CopyRequestBytes, d.CopyRequestBytes}, {&c.CopyMaxBytes, d.CopyMaxBytes},
	} {
		if *v.p <= 0 {
			*v.p = v.def
		}
	}
	dur(&c.CopyPeerTimeout, d.CopyPeerTimeout)
	return c
}

// Validate reports every invalid field.
func (c Config) Validate() error {
	var errs []error
	if _, err := masterlist.Split(c.MasterAddr); err != nil {
		errs = append(errs, err)
	}
	if c.AgentID == "" {
		errs = append(errs, errors.New("agent id is required"))
	}
	if c.DataEndpoint == "" {
		errs = append(errs, errors.New("data endpoint is required"))
	}
	if c.FollowRetry < 0 {
		errs = append(errs, fmt.Errorf("follow retry %v is negative", c.FollowRetry))
	}
	if c.CopyRequestBytes > c.CopyMaxBytes || c.CopyRequestBytes > xfer.MaxDrainBytes {
		errs = append(errs, fmt.Errorf("copy request bytes %d exceed copy max bytes %d or the transfer limit %d", c.CopyRequestBytes, c.CopyMaxBytes, xfer.MaxDrainBytes))
	}
	if c.BackoffMax < c.BackoffBase {
		errs = append(errs, fmt.Errorf("backoff max %v is below backoff base %v", c.BackoffMax, c.BackoffBase))
	}
	return errors.Join(errs...)
}

// Deps are the link's collaborators.
type Deps struct {
	Segments *segment.Set
	// Feed is the change feed of Segments' tables (Set.SetFeed). With it
	// a Connect offers to resume (Register.resume: the table is sent
	// only when the master asks for it) and standbys are followed
	// (Config.FollowStandbys). Nil: every registration sends the table.
	Feed *segment.Feed
	// OnSettings is called with every Settings the master sends (the data
	// plane takes its token key from it). It must not block.
	OnSettings func(*masterv1.Settings)
	// MasterDialOptions are added to the master connection's options
	// (tests dial bufconn). Config.Creds unless overridden.
	MasterDialOptions []grpc.DialOption
	// CopyDialOptions are added to connections to other agents for Copy.
	CopyDialOptions []grpc.DialOption
	// CopyTLS, when set, makes the Copy connections to other agents' bulk
	// transfer listeners TLS with it (per endpoint, xfer.ClientTLS); nil
	// is plaintext.
	CopyTLS *tls.Config
	// Registerer receives the link metrics; nil skips them.
	Registerer prometheus.Registerer
	// Now is the clock for allocation times; nil means time.Now.
	Now func() time.Time
}
