package link

// Following standbys (issue 15, warm standbys). With a table feed
// (Deps.Feed), several master addresses and Config.FollowStandbys, the link
// keeps one follow loop per address of the list, beside the Connect
// session, each on a connection of its own dialled like the session's. A
// loop opens SegmentService.Follow and registers as a Connect does, with
// the whole table and the feed's position read before the table was taken;
// once the standby answers Settings (standby set) it sends a TableDelta for
// every run of changes after that position, and heartbeats. The standby so
// holds the agent's table when it is elected, and the agent's Connect to it
// resumes without the table.
//
// The leader (or a master without election) refuses Follow with
// MASTER_IS_LEADER: the loop asks again every FollowRetry, since that
// master may lose the leadership later, and logs it at Debug only. A
// stream the feed's ring has moved past (ErrBehind) ends and follows
// again from scratch, with the whole table. Other failures back off from
// followBackoffMin to followBackoffMax.
//
// Per stream exactly one goroutine (the sender) calls Send: it sends the
// registration, then the deltas and the heartbeats; another receives (a
// standby sends Settings and nothing more, but its status ends the stream).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"sync"
	"time"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/masterlist"
	"github.com/crescent-kv/crescent/internal/retry"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

const (
	// followBackoffMin and followBackoffMax bound the wait after a failed
	// follow attempt (not a MASTER_IS_LEADER answer).
	followBackoffMin = 200 * time.Millisecond
	followBackoffMax = 5 * time.Second
	// maxDeltaChanges and maxDeltaBytes bound one TableDelta.
	maxDeltaChanges = 4096
	maxDeltaBytes   = 1 << 20
	// followLinger is how long a stream waits after a TableDelta that was
	// not full before it reads the feed again, so the changes of a busy
	// agent travel a few hundred to a delta instead of a few dozen: every
	// delta costs both ends a message (framing, syscalls, the standby's
	// per-delta apply), and a standby applies the changes that long later,
	// which nothing waits for (an election takes seconds).
	followLinger = 5 * time.Millisecond
)

var (
	// errMasterIsLeader matches (errors.Is) a MASTER_IS_LEADER answer
	// converted by rpcerr.FromStatus.
	errMasterIsLeader = rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_IS_LEADER, "the master is the leader")
	errNotStandby     = errors.New("master answered Follow with Settings without standby")
	errFollowClosed   = errors.New("master closed the follow stream")
)

// following reports whether Run follows standbys.
func (l *Link) following() bool {
	if !l.cfg.FollowStandbys || l.deps.Feed == nil {
		return false
	}
	for _, a := range l.masters[1:] {
		if a != l.masters[0] {
			return true
		}
	}
	return false
}

// follow keeps the master at addr warm, or asks again whether it stands
// by, until ctx ends.
func (l *Link) follow(ctx context.Context, addr string, conns *masterlist.Conns) {
	bo := retry.NewBackoff(followBackoffMin, followBackoffMax)
	failures := 0 // failed attempts in a row (MASTER_IS_LEADER is not one)
	var t *time.Timer
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	for {
		cc, err := conns.Get(addr)
		established := false
		if err == nil {
			established, err = l.followOnce(ctx, addr, masterv1.NewSegmentServiceClient(cc))
		}
		if ctx.Err() != nil {
			return
		}
		if established {
			bo.Reset()
			failures = 0
		}
		var delay time.Duration
		switch {
		case errors.Is(rpcerr.FromStatus(err), errMasterIsLeader):
			delay = jitterDown(l.cfg.FollowRetry)
			if established {
				// Elected while followed: the session goes to it now,
				// not when its session with the old leader fails.
				l.noteElected(addr)
				l.lg.Info("followed master is the leader now; asking again later", "master", addr, "retry_in", delay)
			} else {
				l.lg.Debug("master is the leader; asking again later", "master", addr, "retry_in", delay)
			}
		case errors.Is(err, segment.ErrBehind):
			l.met.followResyncs.Inc()
			delay = bo.Next()
			l.lg.Warn("follow stream fell behind the table feed; following again with the whole table", "master", addr, "err", err, "retry_in", delay)
		default:
			failures++
			delay = bo.Next()
			if established || failures == 1 {
				l.lg.Warn("following master failed; retrying", "master", addr, "err", err, "established", established, "retry_in", delay)
			} else {
				l.lg.Debug("following master failed; retrying", "master", addr, "err", err, "failures", failures, "retry_in", delay)
			}
		}
		if t == nil {
			t = time.NewTimer(delay)
		} else {
			t.Reset(delay)
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
	}
}

// jitterDown draws from [4/5 d, d], so agents asking a leader do not ask
// in step.
func jitterDown(d time.Duration) time.Duration {
	if d <= 0 {
		return 0
	}
	return d - rand.N(d/5+1)
}

// followStream is one Follow stream's state.
type followStream struct {
	l      *Link
	ctx    context.Context
	cancel context.CancelCauseFunc
	stream masterv1.SegmentService_FollowClient
	// start hands the heartbeat interval of the standby's Settings to the
	// sender, which then begins the deltas.
	start chan time.Duration
}

// followOnce runs one Follow stream to addr. established reports whether
// the standby accepted the registration (Settings with standby).
func (l *Link) followOnce(parent context.Context, addr string, client masterv1.SegmentServiceClient) (established bool, err error) {
	ctx, cancel := context.WithCancelCause(parent)
	defer cancel(nil)
	began := time.Now()
	stream, err := client.Follow(ctx)
	if err != nil {
		return false, err
	}
	f := &followStream{l: l, ctx: ctx, cancel: cancel, stream: stream, start: make(chan time.Duration, 1)}

	// The position first: the table taken after it shows every change up
	// to it, and the deltas carry every change after it.
	inst, from := l.deps.Feed.Position()
	r := &masterv1.Register{
		AgentId: l.cfg.AgentID, HostId: l.cfg.HostID, DataEndpoint: l.cfg.DataEndpoint, TransferEndpoint: l.cfg.TransferEndpoint,
		Segments: l.deps.Segments.Infos(), KnownEpoch: l.epoch.Load(), Version: l.cfg.Version,
		TablePosition: &masterv1.TablePosition{Instance: inst, Version: from},
	}
	reg := newRegistration(r, tableParts(l.deps.Segments, r))
	allocations := reg.count

	uploaded := make(chan struct{})
	answer := make(chan *masterv1.ConnectResponse, 1)
	recvErr := make(chan error, 1)
	var wg sync.WaitGroup
	defer func() {
		cancel(nil)
		wg.Wait()
	}()
	wg.Go(func() {
		if !reg.messages(f.send) {
			return
		}
		close(uploaded)
		f.sendLoop(from)
	})
	wg.Go(func() { f.recvLoop(answer, recvErr) })

	var t *time.Timer
	var settingsC <-chan time.Time
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	var st *masterv1.Settings
	for st == nil {
		select {
		case <-uploaded:
			uploaded = nil
			t = time.NewTimer(l.cfg.SettingsTimeout)
			settingsC = t.C
		case msg := <-answer:
			if st = msg.GetSettings(); st == nil {
				return false, fmt.Errorf("master sent %T on Follow before Settings", msg.GetMsg())
			}
		case err := <-recvErr:
			return false, f.cause(err)
		case <-settingsC:
			return false, errSettingsTimeout
		case <-ctx.Done():
			return false, context.Cause(ctx)
		}
	}
	if !st.GetStandby() {
		return false, errNotStandby
	}
	iv := st.GetHeartbeatInterval().AsDuration()
	if st.GetHeartbeatInterval() == nil || iv <= 0 {
		iv = time.Second
	}
	l.met.followEstablished.Inc()
	l.met.following.Inc()
	defer l.met.following.Dec()
	l.lg.Info("following standby master", "master", addr, "allocations", allocations, "instance", inst, "version", from,
		"took", time.Since(began).Round(time.Millisecond).String())
	f.start <- iv

	select {
	case err := <-recvErr:
		if errors.Is(err, io.EOF) {
			err = errFollowClosed
		}
		return true, f.cause(err)
	case <-ctx.Done():
		return true, context.Cause(ctx)
	}
}

// cause is why the stream ended: the sender's reason when it cut the
// stream (ErrBehind, a failed Send), which also fails the receive, else
// err.
func (f *followStream) cause(err error) error {
	if f.ctx.Err() != nil {
		return context.Cause(f.ctx)
	}
	return err
}

// send sends msg; false when the stream is over. io.EOF means the master
// ended it: its status is what recvLoop receives next.
func (f *followStream) send(msg *masterv1.ConnectRequest) bool {
	if err := f.stream.Send(msg); err != nil {
		if !errors.Is(err, io.EOF) {
			f.cancel(fmt.Errorf("send to master: %w", err))
		}
		return false
	}
	return true
}

// recvLoop hands the first message to answer and ignores later ones (a
// standby sends nothing after its Settings; a newer one might); the
// stream's end goes to errc.
func (f *followStream) recvLoop(answer chan<- *masterv1.ConnectResponse, errc chan<- error) {
	first := true
	for {
		msg, err := f.stream.Recv()
		if err != nil {
			errc <- err
			return
		}
		if first {
			first = false
			answer <- msg
		}
	}
}

// sendLoop runs on the goroutine that sent the registration, the stream's
// only sender: from the standby's Settings on, it sends the changes after
// version from in TableDeltas, as soon as there are any (what gathered
// while the previous one was sent, and followLinger after it, goes in
// one), and a heartbeat every interval.
func (f *followStream) sendLoop(from uint64) {
	var iv time.Duration
	select {
	case iv = <-f.start:
	case <-f.ctx.Done():
		return
	}
	feed := f.l.deps.Feed
	ticker := time.NewTicker(iv)
	defer ticker.Stop()
	var seq uint64
	heartbeat := func() bool {
		seq++
		return f.send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_Heartbeat{Heartbeat: &masterv1.Heartbeat{
			Seq: seq, Segments: f.l.deps.Segments.Infos(),
		}}})
	}
	buf := make([]segment.Change, 0, maxDeltaChanges)
	linger := time.NewTimer(followLinger)
	linger.Stop()
	defer linger.Stop()
	for {
		// A steady run of changes must not hold the heartbeats back.
		select {
		case <-ticker.C:
			if !heartbeat() {
				return
			}
		default:
		}
		changes, err := feed.Read(buf[:0], from, maxDeltaChanges)
		if err != nil {
			f.cancel(err)
			return
		}
		if len(changes) > 0 {
			d := newDelta(from, changes)
			if !f.send(&masterv1.ConnectRequest{Msg: &masterv1.ConnectRequest_TableDelta{TableDelta: d}}) {
				return
			}
			f.l.met.followDeltas.Inc()
			f.l.met.followChanges.Add(float64(d.GetVersion() - from))
			full := d.GetVersion()-from < uint64(len(changes)) || len(changes) == maxDeltaChanges
			from = d.GetVersion()
			clear(changes) // collectable once the ring lets them go
			if !full {
				linger.Reset(followLinger)
				select {
				case <-linger.C:
				case <-f.ctx.Done():
					return
				}
			}
			continue
		}
		select {
		case <-feed.Changed(from):
		case <-ticker.C:
			if !heartbeat() {
				return
			}
		case <-f.ctx.Done():
			return
		}
	}
}

// newDelta is the TableDelta of the first of changes (the changes after
// version from) that fit in maxDeltaBytes, at least one.
func newDelta(from uint64, changes []segment.Change) *masterv1.TableDelta {
	d := &masterv1.TableDelta{FromVersion: from}
	size, n := 0, 0
	for _, c := range changes {
		a := c.Allocation()
		sz := a.SizeVT() + 4
		if n > 0 && size+sz > maxDeltaBytes {
			break
		}
		size += sz
		n++
		if c.Released() {
			d.Released = append(d.Released, a)
		} else {
			d.Sealed = append(d.Sealed, a)
		}
	}
	d.Version = from + uint64(n)
	return d
}
