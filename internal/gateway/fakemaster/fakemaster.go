// Package fakemaster is a scripted, in-process ChangeService for the
// gateway's tests: a readable set, a dense change log that can be compacted,
// an epoch that changes on a simulated restart, and Watch streams that can
// be dropped. It follows change.proto's contract (errors carry the
// REVISION_COMPACTED / EPOCH_MISMATCH / INVALID_PARAMS reasons via rpcerr).
package fakemaster

import (
	"cmp"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/obs/tracing"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Key names one readable object on one medium.
type Key struct {
	Tenant, Key string
	Medium      masterv1.Medium
}

// Master is the fake. Safe for concurrent use.
type Master struct {
	masterv1.UnimplementedChangeServiceServer

	// MaxPerResponse bounds changes per WatchResponse; PageSize entries per
	// Snapshot page. Set before serving.
	MaxPerResponse int
	PageSize       int

	WatchCalls, SnapshotCalls atomic.Int64

	// mu guards every field below.
	mu          sync.Mutex
	epoch       uint64
	base        uint64 // records at or below base are compacted away
	log         []*masterv1.Change
	set         map[Key]string
	changed     chan struct{} // closed and replaced on every append
	drop        chan struct{} // closed and replaced to end open Watch streams
	dropGen     uint64        // bumped with every drop
	down        bool
	ignoreEpoch bool
	held        bool
	heldAt      uint64 // while held, Watch sends nothing beyond this revision
}

// New returns an empty master at epoch.
func New(epoch uint64) *Master {
	return &Master{
		MaxPerResponse: 64, PageSize: 100,
		epoch: epoch, set: map[Key]string{}, changed: make(chan struct{}), drop: make(chan struct{}),
	}
}

// Serve starts a gRPC server on a loopback port; stop it with the returned func.
func Serve(m *Master) (addr string, stop func(), err error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	gs := grpc.NewServer(rpccodec.ServerOption(), tracing.ServerOption()) // the master's codec, traced like it
	masterv1.RegisterChangeServiceServer(gs, m)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = gs.Serve(l)
	}()
	return l.Addr().String(), func() { gs.Stop(); <-done }, nil
}

func (m *Master) appendLocked(ch *masterv1.Change) {
	m.appendQuietLocked(ch)
	m.wakeLocked()
}

func (m *Master) appendQuietLocked(ch *masterv1.Change) {
	ch.Revision = m.base + uint64(len(m.log)) + 1
	ch.TimestampUnixMs = time.Now().UnixMilli()
	m.log = append(m.log, ch)
}

// wakeLocked tells waiting Watch streams that the log or the hold changed.
func (m *Master) wakeLocked() {
	close(m.changed)
	m.changed = make(chan struct{})
}

// Append appends changes to the log as given (assigning their revisions and
// timestamps) in one batch with one wake-up of the Watch streams, as the
// master commits a batch. It does not touch the readable set, so Snapshot
// and Readable no longer match the log: for benchmarks that only watch, so
// that the fake's own set does not grow with the workload.
func (m *Master) Append(changes ...*masterv1.Change) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, ch := range changes {
		m.appendQuietLocked(ch)
	}
	m.wakeLocked()
}

// Hold makes Watch streams stop at the current head: what is appended
// while held is sent only after Release. Benchmarks build a backlog with
// it, so that what they time is the stream and its follower.
func (m *Master) Hold() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.held {
		m.held, m.heldAt = true, m.base+uint64(len(m.log))
	}
}

// Release ends a Hold.
func (m *Master) Release() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.held = false
	m.wakeLocked()
}

// Put makes (tenant, key) readable on medium. An existing object is
// upserted: removed, then stored, as the master does.
func (m *Master) Put(tenant, key string, med masterv1.Medium, group string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	k := Key{tenant, key, med}
	if _, ok := m.set[k]; ok {
		m.appendLocked(&masterv1.Change{Type: masterv1.ChangeType_CHANGE_TYPE_REMOVED, Tenant: tenant, Key: key, Medium: med})
	}
	m.set[k] = group
	m.appendLocked(&masterv1.Change{Type: masterv1.ChangeType_CHANGE_TYPE_STORED, Tenant: tenant, Key: key, Medium: med, GroupId: group})
}

// Remove makes (tenant, key) unreadable on medium, if it was readable.
func (m *Master) Remove(tenant, key string, med masterv1.Medium) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	k := Key{tenant, key, med}
	if _, ok := m.set[k]; !ok {
		return false
	}
	delete(m.set, k)
	m.appendLocked(&masterv1.Change{Type: masterv1.ChangeType_CHANGE_TYPE_REMOVED, Tenant: tenant, Key: key, Medium: med})
	return true
}

// RemoveAll empties a tenant, recording cleared only when it held objects.
func (m *Master) RemoveAll(tenant string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for k := range m.set {
		if k.Tenant == tenant {
			delete(m.set, k)
			n++
		}
	}
	if n > 0 {
		m.appendLocked(&masterv1.Change{Type: masterv1.ChangeType_CHANGE_TYPE_CLEARED, Tenant: tenant})
	}
}

// Compact drops all but the newest keep records.
func (m *Master) Compact(keep int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if n := len(m.log) - keep; n > 0 {
		m.base += uint64(n)
		m.log = slices.Clone(m.log[n:])
	}
}

// Restart simulates a master restart or failover: a new epoch and an empty
// log (revisions start again at 1); the readable set survives.
func (m *Master) Restart(epoch uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.epoch, m.base, m.log, m.held = epoch, 0, nil, false
	m.dropGen++
	close(m.drop)
	m.drop = make(chan struct{})
}

// DropStreams ends every open Watch stream with UNAVAILABLE.
func (m *Master) DropStreams() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.dropGen++
	close(m.drop)
	m.drop = make(chan struct{})
}

// SetDown makes every call fail with UNAVAILABLE (and drops open streams).
func (m *Master) SetDown(down bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.down = down
	if down {
		close(m.drop)
		m.drop = make(chan struct{})
	}
}

// IgnoreRequestEpoch makes Watch skip its epoch check, so a caller learns
// of a new epoch only from the responses.
func (m *Master) IgnoreRequestEpoch(v bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.ignoreEpoch = v
}

// Readable returns a copy of the readable set.
func (m *Master) Readable() map[Key]string {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[Key]string, len(m.set))
	for k, v := range m.set {
		out[k] = v
	}
	return out
}

// Head is the latest revision.
func (m *Master) Head() uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.base + uint64(len(m.log))
}

// Epoch is the current epoch.
func (m *Master) Epoch() uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.epoch
}

var errDown = status.Error(codes.Unavailable, "fake master is down")

// Watch implements ChangeService.Watch.
func (m *Master) Watch(req *masterv1.WatchRequest, stream grpc.ServerStreamingServer[masterv1.WatchResponse]) error {
	ctx := stream.Context()
	next := req.GetFromRevision()
	first := true
	m.mu.Lock()
	gen := m.dropGen
	m.WatchCalls.Add(1) // under mu: a drop after this is seen by this stream
	m.mu.Unlock()
	for {
		m.mu.Lock()
		if m.down {
			m.mu.Unlock()
			return errDown
		}
		if m.dropGen != gen {
			m.mu.Unlock()
			return status.Error(codes.Unavailable, "fake master dropped the stream")
		}
		if first && !m.ignoreEpoch && req.GetEpoch() != 0 && req.GetEpoch() != m.epoch {
			epoch := m.epoch // read under mu: Restart changes it
			m.mu.Unlock()
			return rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_EPOCH_MISMATCH,
				"epoch %d is not the current epoch %d", req.GetEpoch(), epoch))
		}
		head := m.base + uint64(len(m.log))
		if next > head {
			m.mu.Unlock()
			return rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS,
				"from_revision %d is beyond head %d", next, head))
		}
		if next < m.base {
			oldest := m.base + 1 // read under mu: Compact moves it
			m.mu.Unlock()
			return rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_REVISION_COMPACTED,
				"revision %d compacted; oldest retained is %d", next, oldest))
		}
		visible := head
		if m.held {
			visible = max(min(m.heldAt, head), next)
		}
		var out []*masterv1.Change
		for _, ch := range m.log[next-m.base : visible-m.base] {
			if len(out) == m.MaxPerResponse {
				break
			}
			out = append(out, ch)
		}
		resp := &masterv1.WatchResponse{Changes: out, Epoch: m.epoch, HeadRevision: head, CompactRevision: m.base + 1}
		changed, drop := m.changed, m.drop
		m.mu.Unlock()
		if len(out) > 0 || first {
			if err := stream.Send(resp); err != nil {
				return err
			}
			next += uint64(len(out))
			first = false
		}
		if len(out) == m.MaxPerResponse {
			continue
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-drop:
			return status.Error(codes.Unavailable, "fake master dropped the stream")
		case <-changed:
		}
	}
}

// Snapshot implements ChangeService.Snapshot.
func (m *Master) Snapshot(req *masterv1.SnapshotRequest, stream grpc.ServerStreamingServer[masterv1.SnapshotResponse]) error {
	m.SnapshotCalls.Add(1)
	m.mu.Lock()
	if m.down {
		m.mu.Unlock()
		return errDown
	}
	rev, epoch := m.base+uint64(len(m.log)), m.epoch
	entries := make([]*masterv1.SnapshotEntry, 0, len(m.set))
	for k, g := range m.set {
		if req.GetTenant() == "" || req.GetTenant() == k.Tenant {
			entries = append(entries, &masterv1.SnapshotEntry{Tenant: k.Tenant, Key: k.Key, Medium: k.Medium, GroupId: g})
		}
	}
	m.mu.Unlock()
	slices.SortFunc(entries, func(a, b *masterv1.SnapshotEntry) int {
		return cmp.Or(cmp.Compare(a.Tenant, b.Tenant), cmp.Compare(a.Key, b.Key), cmp.Compare(a.Medium, b.Medium))
	})
	for i := 0; ; i += m.PageSize {
		end := min(i+m.PageSize, len(entries))
		last := end == len(entries)
		if err := stream.Send(&masterv1.SnapshotResponse{Revision: rev, Epoch: epoch, Entries: entries[i:end], Last: last}); err != nil {
			return err
		}
		if last {
			return nil
		}
	}
}
