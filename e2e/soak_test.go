package e2e

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/pkg/client"
	"github.com/crescent-kv/crescent/pkg/kvevent"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestSoak runs a cluster under a random workload and random faults for
// CRESCENT_SOAK (a duration; the test is skipped without it: `make soak`),
// and checks what a client and a subscriber may rely on:
//
//   - a get never returns bytes that are not a put's bytes of that key
//     (every value carries its key's hash, its version and its length,
//     and a body that can be regenerated);
//   - a get never returns a stale version: once a put or a remove of a key
//     was acknowledged with no other write of that key in flight, a get
//     that starts afterwards returns that version or a newer one (or
//     nothing: eviction and lost agents may take any object);
//   - no call fails with a code that means a bug (INTERNAL, UNKNOWN without
//     a context error, INVALID_ARGUMENT, PERMISSION_DENIED, ...);
//   - at every checkpoint (writers paused, every process back): the
//     subscriber's index equals the leader's readable set with no
//     unrepaired gap and no reset, and every object the leader lists reads
//     back with valid bytes;
//   - at the end, once every object is removed, the agents hold no bytes
//     (nothing leaked) and the leader owes no release;
//   - no process panicked.
//
// The cluster: three masters on etcd, three agents with memory and disk, a
// gateway. The faults, one at a time every few seconds: the leader killed,
// an agent killed (restarted after up to 5 s, past the 3 s unmount window
// or not), an agent stopped cleanly, an agent frozen with SIGSTOP for up to
// 4 s, an agent frozen, 8 keys removed (past --suspect-after: those on
// it owe it releases, which a new leader must not undo) and the leader
// killed, the gateway killed or stopped, and a byte flipped in a disk
// replica.
//
// CRESCENT_SOAK_SEED fixes the random choices (the seed is logged).
func TestSoak(t *testing.T) {
	d, err := time.ParseDuration(os.Getenv("CRESCENT_SOAK"))
	if err != nil || d <= 0 {
		t.Skip("CRESCENT_SOAK (a duration) is not set: make soak")
	}
	seed := uint64(envInt(t, "CRESCENT_SOAK_SEED", int(time.Now().UnixNano()%1e9)))
	t.Logf("soak for %v, CRESCENT_SOAK_SEED=%d", d, seed)
	s := newSoak(t, seed)
	s.run(d)
}

// soakTenants and soakKeys shape the key space: small enough that writes
// of one key meet (and that eviction keeps working), large enough that
// most writes do not.
var soakTenants = []string{"t1", "t2"}

const (
	soakKeys    = 150
	soakWorkers = 4
	// soakPool is the random bytes values are cut from.
	soakPool    = 4 << 20
	soakMaxSize = 1 << 20
	soakHeader  = 24
)

type soak struct {
	t    *testing.T
	c    *Cluster
	rng  *rand.Rand // the fault injector's (one goroutine)
	seed uint64
	pool []byte
	cls  map[string]*client.Client
	adm  map[string]*client.Client // admin clients per tenant
	sub  *kvevent.Subscriber

	seq atomic.Uint64 // versions and operation order, shared

	mu   sync.Mutex
	keys map[string]*soakKey // tenant + "/" + key
	// outcomes counts each operation's result by kind and class.
	outcomes map[string]int
	bad      []string // violations, reported at the end (and stop the run)
	faults   map[string]int

	// pause: workers hold it shared per operation; a checkpoint holds it.
	pause sync.RWMutex
	stop  atomic.Bool
}

// soakKey is what the workers know of one key.
type soakKey struct {
	maxStarted uint64 // the highest version a put of it started with
	inflight   int    // writes in flight
	starts     uint64 // writes started, ever
	// floors: after a write acknowledged at ackSeq with no other write of
	// the key in flight, gets that start later must see version >= floor.
	floors []soakFloor
	// poisoned: a write of it failed in a way that leaves its effect
	// unknown; its floors no longer hold.
	poisoned bool
	// history: the key's last writes, for a violation's report.
	history []string
}

type soakFloor struct {
	floor, ackSeq uint64
	what          string // the write that set it
}

// note adds an event to k's history (s.mu held).
func (k *soakKey) note(format string, args ...any) {
	k.history = append(k.history, time.Now().Format("15:04:05.000 ")+fmt.Sprintf(format, args...))
	if len(k.history) > 12 {
		k.history = k.history[1:]
	}
}

func newSoak(t *testing.T, seed uint64) *soak {
	c := StartCluster(t, Options{Masters: 3, Agents: 3, Disk: true, Gateway: true,
		AgentMemory: "32MiB", DiskSize: "64MiB",
		SuspectAfter: time.Second, UnmountAfter: 3 * time.Second,
		MasterFlags: []string{"--etcd-lease-ttl", "2s", "--recovery-grace", "500ms", "--lease-ttl", "2s",
			"--reserved-grace", "20s", "--put-timeout", "10s"},
		AgentFlags: []string{"--scrub-interval", "15s"}})
	s := &soak{t: t, c: c, seed: seed, rng: rand.New(rand.NewPCG(seed, 1)),
		pool: make([]byte, soakPool), cls: map[string]*client.Client{}, adm: map[string]*client.Client{},
		keys: map[string]*soakKey{}, outcomes: map[string]int{}, faults: map[string]int{}}
	prng := rand.New(rand.NewPCG(seed, 2))
	for i := 0; i < len(s.pool); i += 8 {
		binary.LittleEndian.PutUint64(s.pool[i:], prng.Uint64())
	}
	for _, tn := range soakTenants {
		s.cls[tn] = c.Client(tn)
		s.adm[tn] = c.AdminClient(tn)
	}
	return s
}

func keyHash(tenant, key string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(tenant))
	h.Write([]byte{0})
	h.Write([]byte(key))
	return h.Sum64()
}

// bodyOffset is where in the pool a value's body starts.
func (s *soak) bodyOffset(kh, version uint64, n int) int {
	return int((kh ^ version*0x9e3779b97f4a7c15) % uint64(len(s.pool)-n))
}

// value builds version's value of (tenant, key), n bytes.
func (s *soak) value(tenant, key string, version uint64, n int) []byte {
	kh := keyHash(tenant, key)
	v := make([]byte, n)
	binary.LittleEndian.PutUint64(v[0:], kh)
	binary.LittleEndian.PutUint64(v[8:], version)
	binary.LittleEndian.PutUint64(v[16:], uint64(n))
	off := s.bodyOffset(kh, version, n)
	copy(v[soakHeader:], s.pool[off:off+n-soakHeader])
	return v
}

// check returns the version v holds, or why v is no value of (tenant, key).
func (s *soak) check(tenant, key string, v []byte) (uint64, error) {
	if len(v) < soakHeader {
		return 0, fmt.Errorf("%d bytes, shorter than any value", len(v))
	}
	kh := keyHash(tenant, key)
	if got := binary.LittleEndian.Uint64(v[0:]); got != kh {
		return 0, fmt.Errorf("a value of another key (hash %x, want %x)", got, kh)
	}
	version := binary.LittleEndian.Uint64(v[8:])
	if n := binary.LittleEndian.Uint64(v[16:]); n != uint64(len(v)) {
		return version, fmt.Errorf("version %d: %d bytes, its header says %d", version, len(v), n)
	}
	off := s.bodyOffset(kh, version, len(v))
	if !bytes.Equal(v[soakHeader:], s.pool[off:off+len(v)-soakHeader]) {
		return version, fmt.Errorf("version %d: the body differs from the bytes put", version)
	}
	return version, nil
}

func (s *soak) key(tenant, key string) *soakKey {
	id := tenant + "/" + key
	k := s.keys[id]
	if k == nil {
		k = &soakKey{}
		s.keys[id] = k
	}
	return k
}

// violation records a broken promise and stops the run.
func (s *soak) violation(format string, args ...any) {
	msg := time.Now().Format("15:04:05.000 ") + fmt.Sprintf(format, args...)
	s.mu.Lock()
	s.bad = append(s.bad, msg)
	s.mu.Unlock()
	s.t.Log("VIOLATION: " + msg)
	s.stop.Store(true)
}

// class names an operation's outcome: "ok", or the code and reason.
func class(err error) string {
	switch {
	case err == nil:
		return "ok"
	case errors.Is(err, client.ErrFewerReplicas):
		return "fewer-replicas"
	case errors.Is(err, context.DeadlineExceeded):
		return "deadline"
	}
	return status.Code(err).String() + "/" + rpcerr.Reason(err)
}

// suspicious: a code no fault here should cause.
func suspicious(err error) bool {
	if err == nil || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, client.ErrFewerReplicas) {
		return false
	}
	switch status.Code(err) {
	case codes.Internal, codes.InvalidArgument, codes.PermissionDenied, codes.Unauthenticated,
		codes.Unimplemented, codes.OutOfRange:
		return true
	case codes.Unknown:
		return rpcerr.Reason(err) == ""
	}
	return false
}

func (s *soak) count(kind string, err error) {
	s.mu.Lock()
	s.outcomes[kind+" "+class(err)]++
	s.mu.Unlock()
	if suspicious(err) {
		s.violation("%s failed with %s: %v", kind, class(err), err)
	}
}

// writeStart registers a write of (tenant, key) and returns its start
// sequence, which is a put's version (put set): taken with the write's
// registration, so a put started after a write was acknowledged has a
// newer version than the floor that write set. (A version taken before,
// as it was, could be older than a remove acknowledged before the put
// started: a get of that put read "stale".) what describes the write
// given its sequence.
func (s *soak) writeStart(tenant, key string, put bool, what func(seq uint64) string) (startSeq, starts uint64, alone bool, desc string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := s.key(tenant, key)
	alone = k.inflight == 0
	k.inflight++
	k.starts++
	startSeq = s.seq.Add(1)
	if put {
		k.maxStarted = max(k.maxStarted, startSeq)
	}
	desc = what(startSeq)
	k.note("start %s (seq %d, alone %v)", desc, startSeq, alone)
	return startSeq, k.starts, alone, desc
}

// same is a write's description whatever its sequence.
func same(what string) func(uint64) string { return func(uint64) string { return what } }

// applied: the write took effect for certain (acknowledged, or refused in a
// way that says where the key stands). unknown: its effect is not known.
type writeResult int

const (
	applied writeResult = iota
	notApplied
	unknown
)

// writeEnd settles a write: floor is the version gets must see from now
// on when it was applied alone (a put's version, or a remove's start
// sequence).
func (s *soak) writeEnd(tenant, key string, floor, starts uint64, alone bool, r writeResult, what string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := s.key(tenant, key)
	k.inflight--
	k.note("end %s: %s", what, class(err))
	switch {
	case r == unknown:
		k.poisoned = true
	case r == applied && alone && k.starts == starts && !k.poisoned:
		k.floors = append(k.floors, soakFloor{floor: floor, ackSeq: s.seq.Add(1), what: what + ": " + class(err)})
		if len(k.floors) > 8 {
			k.floors = k.floors[1:]
		}
	}
}

// checkGet checks a get of (tenant, key) started at startSeq.
func (s *soak) checkGet(kind, tenant, key string, startSeq uint64, v []byte, err error) {
	if err != nil {
		return
	}
	version, bad := s.check(tenant, key, v)
	if bad != nil {
		s.violation("%s %s/%s returned bad bytes: %v", kind, tenant, key, bad)
		return
	}
	if msg := s.stale(tenant, key, startSeq, version); msg != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		where := "the leader's stat: "
		if info, err := s.cls[tenant].Stat(ctx, key); err != nil {
			where += err.Error()
		} else {
			for _, r := range info.Replicas {
				where += fmt.Sprintf("[replica %d %v %v on %s seg %s alloc %d] ", r.GetReplicaId(), r.GetMedium(), r.GetStatus(), r.GetHostId(), r.GetSegmentId(), r.GetAllocationId())
			}
		}
		s.violation("%s %s/%s returned version %d, %s\n\t%s", kind, tenant, key, version, msg, where)
	}
}

// stale says why version of (tenant, key), read by a get started at
// startSeq, is one no get may return ("" when it may).
func (s *soak) stale(tenant, key string, startSeq, version uint64) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := s.key(tenant, key)
	if version > k.maxStarted {
		return fmt.Sprintf("never put (highest %d)", k.maxStarted)
	}
	if k.poisoned {
		return ""
	}
	for _, f := range slices.Backward(k.floors) {
		if f.ackSeq < startSeq {
			if version < f.floor {
				return fmt.Sprintf("stale: %q, acknowledged before the get started, requires %d or newer; the key's last writes:\n\t%s",
					f.what, f.floor, strings.Join(k.history, "\n\t"))
			}
			return ""
		}
	}
	return ""
}

// putResult sorts a put's error.
func putResult(err error) writeResult {
	switch {
	case err == nil, errors.Is(err, client.ErrFewerReplicas):
		return applied
	case errors.Is(err, client.ErrExists), errors.Is(err, client.ErrNoSpace), errors.Is(err, client.ErrQuotaExceeded),
		errors.Is(err, client.ErrBusy), errors.Is(err, client.ErrTooLarge), errors.Is(err, client.ErrLeased):
		return notApplied
	}
	return unknown
}

func removeResult(err error) writeResult {
	switch {
	case err == nil, errors.Is(err, client.ErrNotFound):
		return applied
	case errors.Is(err, client.ErrLeased), errors.Is(err, client.ErrBusy):
		return notApplied
	}
	return unknown
}

func (s *soak) size(rng *rand.Rand) int {
	if rng.IntN(10) == 0 {
		return 256<<10 + rng.IntN(soakMaxSize-256<<10)
	}
	return soakHeader + rng.IntN(64<<10)
}

// putOpts returns a put's random options and their description.
func (s *soak) putOpts(rng *rand.Rand, upsert bool) ([]client.PutOption, string) {
	n := 1 + rng.IntN(2)
	opts := []client.PutOption{client.WithReplicas(n)}
	desc := fmt.Sprintf("replicas %d", n)
	if rng.IntN(4) == 0 {
		opts = append(opts, client.WithMedium(masterv1.Medium_MEDIUM_DISK))
		desc += " disk"
	}
	if upsert {
		opts = append(opts, client.WithUpsert())
		desc += " upsert"
	}
	return opts, desc
}

// removeMany removes ten keys of tenant by prefix, or five by regex, with
// or without force: while a segment is detached (an agent frozen past the
// unmount window) the keys living there must not come back with it.
func (s *soak) removeMany(ctx context.Context, rng *rand.Rand, tenant string) {
	force := rng.IntN(2) == 0
	group := rng.IntN(soakKeys / 10)
	var keys []string
	var what string
	var remove func() (uint64, uint64, error)
	if rng.IntN(2) == 0 {
		prefix := fmt.Sprintf("k%02d", group)
		for i := range 10 {
			keys = append(keys, fmt.Sprintf("%s%d", prefix, i))
		}
		what = fmt.Sprintf("remove prefix %q (force %v)", prefix, force)
		remove = func() (uint64, uint64, error) { return s.cls[tenant].RemoveByPrefix(ctx, prefix, force) }
	} else {
		re := fmt.Sprintf("^k%02d[0-4]$", group)
		for i := range 5 {
			keys = append(keys, fmt.Sprintf("k%02d%d", group, i))
		}
		what = fmt.Sprintf("remove regex %q (force %v)", re, force)
		remove = func() (uint64, uint64, error) { return s.cls[tenant].RemoveByRegex(ctx, re, force) }
	}
	type started struct {
		seq, starts uint64
		alone       bool
	}
	st := make([]started, len(keys))
	for i, k := range keys {
		st[i].seq, st[i].starts, st[i].alone, _ = s.writeStart(tenant, k, false, same(what))
	}
	_, skipped, err := remove()
	r := removeResult(err)
	if r == applied && skipped > 0 {
		r = notApplied // some were kept (leased): which is not known, and either is fine
	}
	for i, k := range keys {
		s.writeEnd(tenant, k, st[i].seq, st[i].starts, st[i].alone, r, what, err)
	}
	s.count("removemany", err)
}

// worker runs random operations until the run stops.
func (s *soak) worker(w int) {
	rng := rand.New(rand.NewPCG(s.seed, uint64(10+w)))
	for !s.stop.Load() {
		tenant := soakTenants[rng.IntN(len(soakTenants))]
		cl := s.cls[tenant]
		key := fmt.Sprintf("k%03d", rng.IntN(soakKeys))
		s.pause.RLock()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		switch op := rng.IntN(20); {
		case op < 6: // put or upsert
			upsert := op >= 4
			n := s.size(rng)
			opts, desc := s.putOpts(rng, upsert)
			version, starts, alone, what := s.writeStart(tenant, key, true, func(v uint64) string {
				return fmt.Sprintf("put v%d (%d B, %s)", v, n, desc)
			})
			v := s.value(tenant, key, version, n)
			err := cl.Put(ctx, key, v, opts...)
			s.writeEnd(tenant, key, version, starts, alone, putResult(err), what, err)
			s.count(map[bool]string{false: "put", true: "upsert"}[upsert], err)
		case op < 7: // batch upsert of 4 keys
			items := make([]client.Item, 4)
			type started struct {
				version, starts uint64
				alone           bool
			}
			st := make([]started, len(items))
			opts, desc := s.putOpts(rng, true)
			whats := make([]string, len(items))
			seen := map[string]bool{}
			for i := range items {
				k := fmt.Sprintf("k%03d", rng.IntN(soakKeys))
				for seen[k] {
					k = fmt.Sprintf("k%03d", rng.IntN(soakKeys))
				}
				seen[k] = true
				n := soakHeader + rng.IntN(16<<10)
				version, starts, alone, what := s.writeStart(tenant, k, true, func(v uint64) string {
					return fmt.Sprintf("batch put v%d (%d B, %s)", v, n, desc)
				})
				items[i] = client.Item{Key: k, Data: s.value(tenant, k, version, n)}
				whats[i] = what
				st[i] = started{version, starts, alone}
			}
			errs := cl.BatchPut(ctx, items, opts...)
			for i, err := range errs {
				s.writeEnd(tenant, items[i].Key, st[i].version, st[i].starts, st[i].alone, putResult(err), whats[i], err)
				s.count("batchput", err)
			}
		case op < 13:
			start := s.seq.Add(1)
			v, err := cl.Get(ctx, key)
			s.checkGet("get", tenant, key, start, v, err)
			s.count("get", err)
		case op < 15:
			keys := make([]string, 8)
			for i := range keys {
				keys[i] = fmt.Sprintf("k%03d", rng.IntN(soakKeys))
			}
			start := s.seq.Add(1)
			vals, errs := cl.BatchGet(ctx, keys)
			for i := range keys {
				s.checkGet("batchget", tenant, keys[i], start, vals[i], errs[i])
				s.count("batchget", errs[i])
			}
		case op == 17 && rng.IntN(4) == 0:
			s.removeMany(ctx, rng, tenant)
		case op < 18:
			force := rng.IntN(2) == 0
			what := fmt.Sprintf("remove (force %v)", force)
			startSeq, starts, alone, _ := s.writeStart(tenant, key, false, same(what))
			err := cl.Remove(ctx, key, force)
			s.writeEnd(tenant, key, startSeq, starts, alone, removeResult(err), what, err)
			s.count("remove", err)
		default:
			_, err := cl.Exist(ctx, key)
			s.count("exist", err)
		}
		cancel()
		s.pause.RUnlock()
	}
}

// removeSome removes n random keys with force, checked as the workers'
// removals are.
func (s *soak) removeSome(n int) {
	s.pause.RLock()
	defer s.pause.RUnlock()
	for range n {
		tenant := soakTenants[s.rng.IntN(len(soakTenants))]
		key := fmt.Sprintf("k%03d", s.rng.IntN(soakKeys))
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		what := "remove (force true, while an agent is frozen)"
		startSeq, starts, alone, _ := s.writeStart(tenant, key, false, same(what))
		err := s.cls[tenant].Remove(ctx, key, true)
		s.writeEnd(tenant, key, startSeq, starts, alone, removeResult(err), what, err)
		s.count("remove", err)
		cancel()
	}
}

// sig sends sig to p's process (a no-op when it is not running).
func (p *Proc) sig(sig syscall.Signal) {
	p.mu.Lock()
	cmd := p.cmd
	p.mu.Unlock()
	if cmd != nil {
		_ = cmd.Process.Signal(sig)
	}
}

// fault injects one random fault and heals it before returning.
func (s *soak) fault() {
	c := s.c
	sleep := func(max time.Duration) { time.Sleep(time.Duration(s.rng.Int64N(int64(max)))) }
	a := c.Agents[s.rng.IntN(len(c.Agents))]
	var name string
	switch f := s.rng.IntN(13); {
	case f < 2:
		lead := c.WaitLeader()
		name = "kill the leader"
		lead.Kill()
		next := c.WaitLeader()
		s.t.Logf("fault: %s (%s); %s leads", name, lead.Name, next.Name)
		lead.start()
	case f < 4:
		name = "kill an agent"
		s.t.Logf("fault: %s (%s)", name, a.Name)
		a.Kill()
		sleep(5 * time.Second)
		a.Restart()
	case f < 5:
		name = "stop an agent"
		s.t.Logf("fault: %s (%s)", name, a.Name)
		a.Stop()
		a.Restart()
	case f < 7:
		name = "freeze an agent"
		s.t.Logf("fault: %s (%s)", name, a.Name)
		a.sig(syscall.SIGSTOP)
		sleep(4 * time.Second)
		a.sig(syscall.SIGCONT)
	case f < 8:
		// Removals past --suspect-after leave releases owed to the
		// frozen agent: the new leader must not serve those objects
		// again (meta/unsettled.go).
		name = "freeze an agent, remove, kill the leader"
		lead := c.WaitLeader()
		a.sig(syscall.SIGSTOP)
		time.Sleep(time.Second)
		sleep(2 * time.Second)
		s.removeSome(8)
		lead.Kill()
		next := c.WaitLeader()
		s.t.Logf("fault: %s (%s, %s); %s leads", name, a.Name, lead.Name, next.Name)
		a.sig(syscall.SIGCONT)
		lead.start()
	case f < 9:
		name = "kill the gateway"
		s.t.Logf("fault: %s", name)
		c.Gateway.Kill()
		c.Gateway.Restart()
	case f < 10:
		name = "stop the gateway"
		s.t.Logf("fault: %s", name)
		c.Gateway.Stop()
		c.Gateway.Restart()
	default:
		name = "flip a byte on disk"
		s.flipDiskByte()
	}
	s.mu.Lock()
	s.faults[name]++
	s.mu.Unlock()
}

// flipDiskByte flips one byte inside a random disk replica.
func (s *soak) flipDiskByte() {
	tenant := soakTenants[s.rng.IntN(len(soakTenants))]
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	hosts := map[string]string{}
	for _, sg := range s.c.Segments() {
		hosts[sg.GetInfo().GetSegmentId()] = sg.GetHostId()
	}
	for range 20 {
		key := fmt.Sprintf("k%03d", s.rng.IntN(soakKeys))
		rl, err := s.adm[tenant].Objects().GetReplicaList(ctx, &masterv1.GetReplicaListRequest{Tenant: tenant, Key: key})
		if err != nil {
			continue
		}
		for _, r := range rl.GetReplicas() {
			if r.GetMedium() != masterv1.Medium_MEDIUM_DISK || r.GetSize() == 0 {
				continue
			}
			host := hosts[r.GetSegmentId()]
			for i := range s.c.Agents {
				if hostID(i) == host {
					off := r.GetOffset() + s.rng.Uint64N(r.GetSize())
					testutil.FlipByte(s.t, filepath.Join(s.c.dir, fmt.Sprintf("agent-%c-disk", 'a'+i), "segment.data"), off)
					s.t.Logf("fault: flip a byte on disk (%s/%s on %s at %d)", tenant, key, host, off)
					return
				}
			}
		}
	}
}

// checkpoint pauses the writers and checks the cluster at rest.
func (s *soak) checkpoint(step string) {
	t, c := s.t, s.c
	s.pause.Lock()
	defer s.pause.Unlock()
	began := time.Now()
	c.WaitLeader()
	c.WaitSegments(2 * len(c.Agents))
	converge(t, c, s.sub)
	if st := s.sub.Stats(); st.Unrepaired != 0 || st.Resets != 0 || st.Malformed != 0 {
		s.violation("%s: subscriber stats %+v: want no unrepaired gap, reset or malformed message", step, st)
	}
	// Every object the leader lists reads back with valid bytes.
	listed, unreadable := 0, map[string]int{}
	for _, tenant := range soakTenants {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		cl := s.cls[tenant]
		var keys []string
		for o, err := range cl.List(ctx, "") {
			if err != nil {
				s.violation("%s: list %s: %v", step, tenant, err)
				break
			}
			if !o.GetProcessing() {
				keys = append(keys, o.GetKey())
			}
		}
		listed += len(keys)
		start := s.seq.Add(1)
		vals, errs := cl.BatchGet(ctx, keys)
		for i, k := range keys {
			s.checkGet("checkpoint get", tenant, k, start, vals[i], errs[i])
			if errs[i] != nil {
				unreadable[class(errs[i])]++
				// A flipped byte may make a listed object unreadable (the
				// read drops the replica); nothing else may.
				if !errors.Is(errs[i], client.ErrChecksum) {
					s.violation("%s: %s/%s listed by the leader but unreadable: %v", step, tenant, k, errs[i])
				}
			}
		}
		cancel()
	}
	t.Logf("checkpoint %s: %d objects listed and read back (unreadable: %v), subscriber index %d keys, %v",
		step, listed, unreadable, len(s.sub.Index().Keys()), time.Since(began).Round(time.Millisecond))
}

func (s *soak) run(d time.Duration) {
	t, c := s.t, s.c
	s.sub = subscribe(t, c)
	var wg sync.WaitGroup
	for w := range soakWorkers {
		wg.Go(func() { s.worker(w) })
	}
	end := time.Now().Add(d)
	nextCheck := time.Now().Add(45 * time.Second)
	for n := 1; time.Now().Before(end) && !s.stop.Load(); {
		time.Sleep(2*time.Second + time.Duration(s.rng.Int64N(int64(4*time.Second))))
		s.fault()
		if time.Now().After(nextCheck) {
			s.checkpoint(strconv.Itoa(n))
			n++
			nextCheck = time.Now().Add(45 * time.Second)
		}
	}
	s.stop.Store(true)
	wg.Wait()
	if len(s.bad) == 0 {
		s.checkpoint("the end")
		s.drainCheck()
	}
	s.report()
}

// drainCheck removes every object and checks that nothing stays behind:
// the subscriber's index is empty, the agents hold no bytes once the
// blank reservations expire, the leader owes no release, no process
// panicked.
func (s *soak) drainCheck() {
	t, c := s.t, s.c
	for _, tenant := range soakTenants {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		if _, skipped, err := s.adm[tenant].RemoveAll(ctx, true); err != nil || skipped != 0 {
			s.violation("RemoveAll %s: %d skipped, %v", tenant, skipped, err)
		}
		cancel()
	}
	converge(t, c, s.sub)
	if n := len(s.sub.Index().Keys()); n != 0 {
		s.violation("after removing everything the subscriber's index holds %d keys", n)
	}
	// Blank reservations are released within half of --reserved-grace
	// (20 s) when unused; spares when their lease ends.
	began := time.Now()
	err := testutil.Poll(t, 90*time.Second, func() error {
		var held []string
		for _, a := range c.Agents {
			if u := c.metric(t, a, "crescent_agent_segment_used_bytes"); u != 0 {
				held = append(held, fmt.Sprintf("%s %v B", a.Name, u))
			}
		}
		if len(held) > 0 {
			return fmt.Errorf("agents still hold bytes after every object was removed: %v", held)
		}
		return nil
	})
	if err != nil {
		lead := c.WaitLeader()
		s.violation("%v (leader: %v blanks, %v spares)", err,
			c.metric(t, lead, "crescent_master_blank_reservations"), c.metric(t, lead, "crescent_master_spares"))
	}
	if err == nil {
		t.Logf("every object removed: the subscriber's index is empty, and the agents held no bytes %v later", time.Since(began).Round(time.Second))
	}
	// retryOwed runs every second: what is still owed 5 s after the agents
	// let go of every byte is owed for allocations nobody holds.
	var owed float64
	_ = testutil.Poll(t, 5*time.Second, func() error {
		if owed = c.metric(t, c.WaitLeader(), "crescent_master_owed_releases"); owed != 0 {
			return fmt.Errorf("owes %v", owed)
		}
		return nil
	})
	if owed != 0 {
		lead := c.WaitLeader()
		var lines []string
		for _, l := range strings.Split(lead.Logs(), "\n") {
			if strings.Contains(l, "owed") || strings.Contains(l, "dropped segments") || strings.Contains(l, "unmount") || strings.Contains(l, "reconciled") || strings.Contains(l, "registered") || strings.Contains(l, "promot") {
				lines = append(lines, l)
			}
		}
		s.violation("the leader (%s) owes %v releases at rest; its log about them:\n%s", lead.Name, owed, tail(strings.Join(lines, "\n"), 150))
	}
	// Segments a new leader distrusted (an earlier leader left a client's
	// removal undone there): their objects were dropped, not served again.
	distrusts, segs := 0, 0
	for _, m := range c.Masters {
		for _, l := range strings.Split(m.Logs(), "\n") {
			if strings.Contains(l, "left unsettled are distrusted") {
				distrusts++
				var n int
				if i := strings.Index(l, `"segments":`); i >= 0 {
					_, _ = fmt.Sscanf(l[i+len(`"segments":`):], "%d", &n)
				}
				segs += n
			}
		}
	}
	t.Logf("elections that distrusted unsettled segments: %d (%d segments)", distrusts, segs)
	for _, p := range append(append([]*Proc{c.Gateway}, c.Agents...), c.Masters...) {
		lg := p.Logs()
		for _, bad := range []string{"panic:", "fatal error:", "DATA RACE"} {
			if i := strings.Index(lg, bad); i >= 0 {
				s.violation("%s logged %q: %s", p.Name, bad, lg[i:min(len(lg), i+2000)])
			}
		}
	}
}

func (s *soak) report() {
	s.mu.Lock()
	defer s.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "faults:")
	for _, k := range slices.Sorted(maps.Keys(s.faults)) {
		fmt.Fprintf(&b, " %s %d;", k, s.faults[k])
	}
	fmt.Fprintf(&b, "\noperations:\n")
	for _, k := range slices.Sorted(maps.Keys(s.outcomes)) {
		fmt.Fprintf(&b, "  %-60s %d\n", k, s.outcomes[k])
	}
	poisoned, floored := 0, 0
	for _, k := range s.keys {
		if k.poisoned {
			poisoned++
		} else if len(k.floors) > 0 {
			floored++
		}
	}
	fmt.Fprintf(&b, "keys: %d written, %d checked for staleness to the end, %d whose writes' effect became unknown\n", len(s.keys), floored, poisoned)
	st := s.sub.Stats()
	fmt.Fprintf(&b, "subscriber: %d batches, %d events, %d replayed, %d missing (%d unrepaired), %d resets, %d reconnects",
		st.Batches, st.Events, st.Replayed, st.MissingSeqs, st.Unrepaired, st.Resets, st.Reconnects)
	s.t.Log(b.String())
	if len(s.bad) > 0 {
		s.t.Fatalf("%d violations (CRESCENT_SOAK_SEED=%d):\n%s", len(s.bad), s.seed, strings.Join(head(s.bad), "\n"))
	}
}
