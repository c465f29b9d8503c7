package app

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/config"
	"github.com/crescent-kv/crescent/internal/obs"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/peer"
	"google.golang.org/protobuf/types/known/durationpb"
)

// The put-cycle benchmark runs the agent in a child process (this test
// binary, re-executed with benchAgentEnv set) so the agent's own CPU time
// and allocations can be read exactly, apart from the fake master and the
// client that drive it from the benchmark process.
const (
	// benchAgentEnv holds the fake master's address in the child.
	benchAgentEnv = "CRESCENT_BENCH_AGENT_MASTER"
	// benchMemoryEnv is the child's --memory in bytes.
	benchMemoryEnv = "CRESCENT_BENCH_AGENT_MEMORY"
	// benchProfileEnv, when set (in the benchmark's environment), makes
	// the child write a CPU profile of the timed part of the last run to
	// that path.
	benchProfileEnv = "CRESCENT_BENCH_AGENT_CPUPROFILE"
	// benchMemProfileEnv, likewise, names an allocation profile (every
	// allocation of the timed parts of the child's runs).
	benchMemProfileEnv = "CRESCENT_BENCH_AGENT_MEMPROFILE"
	// benchFillEnv overrides how many sealed 4 KiB objects the table holds
	// before timing starts (default benchFill).
	benchFillEnv = "CRESCENT_BENCH_FILL"
	// benchFollowEnv, when set, lists the fake master three times in the
	// child's --master, by three addresses it listens on: the agent then
	// keeps its table change feed and, beside its session, Follow streams
	// the fake master serves as a standby, two as the standbys of a
	// cluster of three masters (issue 15, warm standbys).
	benchFollowEnv = "CRESCENT_BENCH_FOLLOW"
	// benchStandbysEnv holds the two standby addresses in the child.
	benchStandbysEnv = "CRESCENT_BENCH_AGENT_STANDBYS"
)

const (
	benchBatch  = 128     // objects per Reserve / transfer / Seal
	benchObject = 4 << 10 // bytes per object
	benchWindow = 8       // batches each worker keeps live before releasing its oldest
	benchFill   = 48 << 10
	benchMemory = 256 << 20
	benchTenant = "bench"
)

// benchAgentChild runs an agent for the put-cycle benchmark until its stdin
// ends. It answers "stat" lines on stdout with its CPU time (ns, user +
// system), its heap allocation count, its GC count and the bytes it
// allocated, and starts the CPU profile named by benchProfileEnv on
// "profile".
func benchAgentChild(master string) int {
	memProf := os.Getenv(benchMemProfileEnv)
	if memProf != "" {
		runtime.MemProfileRate = 0 // set on "profile": the timed part only
	}
	cfg := DefaultConfig()
	cfg.Master, cfg.GRPCAddr, cfg.AdminAddr, cfg.HostID = master, "127.0.0.1:0", "127.0.0.1:0", "bench"
	if sb := os.Getenv(benchStandbysEnv); sb != "" {
		cfg.Master = master + "," + sb
	}
	cfg.Memory, cfg.MemorySegments = config.ByteSize(benchMemory), 1
	if v, err := strconv.ParseUint(os.Getenv(benchMemoryEnv), 10, 64); err == nil && v > 0 {
		cfg.Memory = config.ByteSize(v)
	}
	cfg.ShutdownGrace, cfg.ShutdownTimeout = 0, time.Second
	if err := cfg.Validate(); err != nil {
		fmt.Fprintln(os.Stderr, "bench agent:", err)
		return 2
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- New(cfg, testutil.Logger(), obs.NewRegistry()).Run(ctx) }()
	var prof *os.File
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		switch sc.Text() {
		case "stat":
			var ru syscall.Rusage
			_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			fmt.Printf("stat %d %d %d %d\n", ru.Utime.Nano()+ru.Stime.Nano(), ms.Mallocs, ms.NumGC, ms.TotalAlloc)
		case "profile":
			if memProf != "" {
				runtime.MemProfileRate = 1
			}
			if path := os.Getenv(benchProfileEnv); path != "" && prof == nil {
				f, err := os.Create(path)
				if err == nil {
					if err = pprof.StartCPUProfile(f); err == nil {
						prof = f
					}
				}
				if err != nil {
					fmt.Fprintln(os.Stderr, "bench agent: cpu profile:", err)
				}
			}
			fmt.Println("ok")
		}
	}
	if prof != nil {
		pprof.StopCPUProfile()
		_ = prof.Close()
	}
	if memProf != "" {
		runtime.MemProfileRate = 0
		if f, err := os.Create(memProf); err == nil {
			_ = pprof.Lookup("allocs").WriteTo(f, 0)
			_ = f.Close()
		}
	}
	cancel()
	if err := <-done; err != nil {
		fmt.Fprintln(os.Stderr, "bench agent:", err)
		return 1
	}
	return 0
}

// benchMaster is a SegmentService for the benchmark: it hands over the
// agent's session and routes the agent's answers to the waiting requests
// by request id. It serves Follow as a standby that takes the table and
// counts the changes of the deltas; the leader at its first address
// answers Follow with MASTER_IS_LEADER.
type benchMaster struct {
	masterv1.UnimplementedSegmentServiceServer
	sessions chan *benchSession
	leader   string        // the address that answers Follow as the leader
	followed atomic.Uint64 // changes received in TableDeltas
}

// peerLocalAddr is the address the stream's connection reached.
func peerLocalAddr(ctx context.Context) (string, bool) {
	p, ok := peer.FromContext(ctx)
	if !ok || p.LocalAddr == nil {
		return "", false
	}
	return p.LocalAddr.String(), true
}

func (m *benchMaster) Follow(stream masterv1.SegmentService_FollowServer) error {
	if p, ok := peerLocalAddr(stream.Context()); ok && p == m.leader {
		return rpcerr.Status(rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_MASTER_IS_LEADER, "the benchmark's leader"))
	}
	if _, err := recvRegister(stream); err != nil {
		return err
	}
	if err := stream.Send(&masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Settings{Settings: &masterv1.Settings{
		Standby: true, HeartbeatInterval: durationpb.New(time.Second),
	}}}); err != nil {
		return err
	}
	for {
		msg, err := stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		if d := msg.GetTableDelta(); d != nil {
			m.followed.Add(d.GetVersion() - d.GetFromVersion())
		}
	}
}

type benchSession struct {
	reg    *masterv1.Register
	stream masterv1.SegmentService_ConnectServer
	sendMu sync.Mutex
	nextID atomic.Uint64

	mu      sync.Mutex
	waiting map[uint64]chan *masterv1.ConnectRequest
}

func (m *benchMaster) Connect(stream masterv1.SegmentService_ConnectServer) error {
	reg, err := recvRegister(stream)
	if err != nil {
		return err
	}
	s := &benchSession{reg: reg, stream: stream, waiting: map[uint64]chan *masterv1.ConnectRequest{}}
	select {
	case m.sessions <- s:
	case <-stream.Context().Done():
		return nil
	}
	for {
		msg, err := stream.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		var id uint64
		switch r := msg.GetMsg().(type) {
		case *masterv1.ConnectRequest_ReserveResult:
			id = r.ReserveResult.GetRequestId()
		case *masterv1.ConnectRequest_SealResult:
			id = r.SealResult.GetRequestId()
		case *masterv1.ConnectRequest_ReleaseResult:
			id = r.ReleaseResult.GetRequestId()
		default:
			continue
		}
		s.mu.Lock()
		ch := s.waiting[id]
		delete(s.waiting, id)
		s.mu.Unlock()
		if ch != nil {
			ch <- msg
		}
	}
}

func (s *benchSession) send(msg *masterv1.ConnectResponse) error {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	return s.stream.Send(msg)
}

// call sends a command built for a fresh request id and waits for its
// answer.
func (s *benchSession) call(build func(id uint64) *masterv1.ConnectResponse) (*masterv1.ConnectRequest, error) {
	id := s.nextID.Add(1)
	ch := make(chan *masterv1.ConnectRequest, 1)
	s.mu.Lock()
	s.waiting[id] = ch
	s.mu.Unlock()
	if err := s.send(build(id)); err != nil {
		return nil, err
	}
	select {
	case msg := <-ch:
		return msg, nil
	case <-time.After(30 * time.Second):
		return nil, fmt.Errorf("no answer to request %d", id)
	}
}

// benchChild is the agent process.
type benchChild struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Reader
}

type childStat struct{ cpuNs, mallocs, gcs, bytes uint64 }

func (c *benchChild) command(line string) (string, error) {
	if _, err := io.WriteString(c.in, line+"\n"); err != nil {
		return "", err
	}
	s, err := c.out.ReadString('\n')
	return strings.TrimSpace(s), err
}

func (c *benchChild) stat() (childStat, error) {
	s, err := c.command("stat")
	if err != nil {
		return childStat{}, err
	}
	var st childStat
	if _, err := fmt.Sscanf(s, "stat %d %d %d %d", &st.cpuNs, &st.mallocs, &st.gcs, &st.bytes); err != nil {
		return childStat{}, fmt.Errorf("agent stat %q: %w", s, err)
	}
	return st, nil
}

func (c *benchChild) stop() error {
	_ = c.in.Close()
	return c.cmd.Wait()
}

// BenchmarkPutCycle measures the agent's cost per object of the put cycle of
// `crescentctl bench --mode put --size 4KiB --batch 128`: the master's
// batched Reserve of 128 × 4 KiB over the Connect stream, the client's
// transfer WRITE of the 128 objects (internal/xfer over loopback TCP), and the
// master's batched Seal (hash verification). Each worker keeps its last
// benchWindow batches and releases the oldest one per cycle (a cache in
// steady state), so the loop also pays one Release per object. Before timing,
// the table is filled with benchFill sealed objects, as an agent serving a
// cluster holds.
//
// The agent runs in a child process. agent-cpu-ns/obj is its CPU time (user
// + system, getrusage) over the timed part divided by the objects put,
// agent-allocs/obj and agent-B/obj its heap allocations and bytes per
// object; ns/obj is the wall time.
// Set CRESCENT_BENCH_AGENT_CPUPROFILE=path for a CPU profile of the agent,
// CRESCENT_BENCH_AGENT_MEMPROFILE=path for its allocations (which slows it).
// -benchtime=Nx (N cycles) avoids setting the agent up again for every
// b.N the framework tries. CRESCENT_BENCH_FOLLOW=1 runs the agent of an HA
// cluster: its table feed records every seal and release and two Follow
// streams send them to the fake master (standby-changes/obj: about 2 per
// stream, a seal and a release of each object).
func BenchmarkPutCycle(b *testing.B) {
	for _, conc := range []int{1, 4} {
		b.Run("conc="+strconv.Itoa(conc), func(b *testing.B) { benchPutCycle(b, conc) })
	}
}

func benchPutCycle(b *testing.B, conc int) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	m := &benchMaster{sessions: make(chan *benchSession, 1), leader: lis.Addr().String()}
	gs := grpc.NewServer(rpccodec.ServerOption())
	masterv1.RegisterSegmentServiceServer(gs, m)
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), benchAgentEnv+"="+lis.Addr().String())
	if os.Getenv(benchFollowEnv) != "" {
		var standbys []string
		for range 2 {
			sl, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			go func() { _ = gs.Serve(sl) }()
			standbys = append(standbys, sl.Addr().String())
		}
		cmd.Env = append(cmd.Env, benchStandbysEnv+"="+strings.Join(standbys, ","))
	}
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	child := &benchChild{cmd: cmd, in: in, out: bufio.NewReader(out)}
	defer func() {
		if err := child.stop(); err != nil {
			b.Errorf("agent process: %v", err)
		}
	}()
	var s *benchSession
	select {
	case s = <-m.sessions:
	case <-time.After(60 * time.Second):
		b.Fatal("the agent did not register")
	}
	seg := s.reg.GetSegments()[0].GetSegmentId()
	endpoint := s.reg.GetTransferEndpoint()
	if err := s.send(settingsMsg()); err != nil {
		b.Fatal(err)
	}
	signer := token.NewSigner(key)
	pool := xfer.NewPool(xfer.Config{})
	defer pool.Close()
	ctx := context.Background()

	fill := benchFill
	if v, err := strconv.Atoi(os.Getenv(benchFillEnv)); err == nil && v >= 0 {
		fill = v
	}
	zeroSum := checksum.Sum(make([]byte, benchObject))
	for n := 0; n < fill; n += benchBatch {
		w := newBenchWorker(s, seg, "fill", min(benchBatch, fill-n))
		ids, err := w.reserve()
		if err != nil {
			b.Fatal(err)
		}
		for i := range w.sums {
			w.sums[i] = zeroSum // the pages were prefaulted with zeros
		}
		if err := w.seal(ids); err != nil {
			b.Fatal(err)
		}
	}

	workers := make([]*benchWorker, conc)
	for i := range workers {
		workers[i] = newBenchWorker(s, seg, "w"+strconv.Itoa(i), benchBatch)
	}
	cycle := func(w *benchWorker) error {
		ids, err := w.reserve()
		if err != nil {
			return err
		}
		exp := time.Now().Add(time.Minute)
		for i, id := range ids {
			it := w.items[i]
			it.AllocationId = id
			it.Token = signer.Sign(token.Claims{Mode: token.Write, Tenant: benchTenant, Key: w.keys[i], SegmentID: seg, AllocationID: id, Expiry: exp})
		}
		errs, err := pool.Write(ctx, endpoint, w.items, w.src)
		if err != nil {
			return err
		}
		for i, err := range errs {
			if err != nil {
				return fmt.Errorf("write item %d: %w", i, err)
			}
		}
		if err := w.seal(ids); err != nil {
			return err
		}
		w.live = append(w.live, ids)
		if len(w.live) > benchWindow {
			old := w.live[0]
			w.live = w.live[1:]
			return w.release(old)
		}
		return nil
	}
	// Warm up: connections, the agent's pools and buffers.
	for _, w := range workers {
		if err := cycle(w); err != nil {
			b.Fatal(err)
		}
	}

	if _, err := child.command("profile"); err != nil {
		b.Fatal(err)
	}
	st0, err := child.stat()
	if err != nil {
		b.Fatal(err)
	}
	followed0 := m.followed.Load()
	b.ResetTimer()
	var next atomic.Int64
	var wg sync.WaitGroup
	errc := make(chan error, conc)
	for _, w := range workers {
		wg.Go(func() {
			for next.Add(1) <= int64(b.N) {
				if err := cycle(w); err != nil {
					errc <- err
					return
				}
			}
		})
	}
	wg.Wait()
	b.StopTimer()
	st1, err := child.stat()
	if err != nil {
		b.Fatal(err)
	}
	select {
	case err := <-errc:
		b.Fatal(err)
	default:
	}
	objs := float64(b.N) * benchBatch
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/objs, "ns/obj")
	b.ReportMetric(float64(st1.cpuNs-st0.cpuNs)/objs, "agent-cpu-ns/obj")
	b.ReportMetric(float64(st1.mallocs-st0.mallocs)/objs, "agent-allocs/obj")
	b.ReportMetric(float64(st1.bytes-st0.bytes)/objs, "agent-B/obj")
	b.ReportMetric(float64(st1.gcs-st0.gcs)*1e6/objs, "agent-gcs/Mobj")
	if os.Getenv(benchFollowEnv) != "" {
		b.ReportMetric(float64(m.followed.Load()-followed0)/objs, "standby-changes/obj")
	}
}

// benchWorker is one client of the benchmark: its request messages, reused
// from cycle to cycle, and its live batches.
type benchWorker struct {
	s       *benchSession
	seg     string
	reserve func() ([]uint64, error)
	items   []*agentv1.TransferItem
	keys    []string // the object key of each item (its token names it)
	src     [][]byte
	sums    []uint64
	live    [][]uint64
}

func newBenchWorker(s *benchSession, seg, name string, n int) *benchWorker {
	w := &benchWorker{s: s, seg: seg, items: make([]*agentv1.TransferItem, n), keys: make([]string, n), src: make([][]byte, n), sums: make([]uint64, n)}
	ritems := make([]*masterv1.ReserveItem, n)
	for i := range n {
		w.keys[i] = fmt.Sprintf("bench/%s/object-%06d", name, i)
		ritems[i] = &masterv1.ReserveItem{SegmentId: seg, Size: benchObject, Tenant: benchTenant, Key: w.keys[i], ReplicaId: 1}
		w.items[i] = &agentv1.TransferItem{SegmentId: seg}
		w.src[i] = make([]byte, benchObject)
		for j := range w.src[i] {
			w.src[i][j] = byte(i*7 + j*13)
		}
		w.sums[i] = checksum.Sum(w.src[i])
	}
	w.reserve = func() ([]uint64, error) {
		msg, err := s.call(func(id uint64) *masterv1.ConnectResponse {
			return &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Reserve{Reserve: &masterv1.ReserveRequest{RequestId: id, Epoch: 1, Items: ritems}}}
		})
		if err != nil {
			return nil, err
		}
		res := msg.GetReserveResult().GetItems()
		if len(res) != n {
			return nil, fmt.Errorf("reserve answered %d items of %d", len(res), n)
		}
		ids := make([]uint64, n)
		for i, r := range res {
			if r.GetStatus().GetCode() != 0 {
				return nil, fmt.Errorf("reserve item %d: %v", i, r.GetStatus())
			}
			ids[i] = r.GetAllocationId()
		}
		return ids, nil
	}
	return w
}

func (w *benchWorker) seal(ids []uint64) error {
	items := make([]*masterv1.SealItem, len(ids))
	for i, id := range ids {
		items[i] = &masterv1.SealItem{SegmentId: w.seg, AllocationId: id, Checksum: w.sums[i]}
	}
	msg, err := w.s.call(func(id uint64) *masterv1.ConnectResponse {
		return &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Seal{Seal: &masterv1.SealRequest{RequestId: id, Epoch: 1, Items: items}}}
	})
	if err != nil {
		return err
	}
	for i, st := range msg.GetSealResult().GetItems() {
		if st.GetCode() != 0 {
			return fmt.Errorf("seal item %d: %v", i, st)
		}
	}
	return nil
}

func (w *benchWorker) release(ids []uint64) error {
	refs := make([]*masterv1.AllocationRef, len(ids))
	for i, id := range ids {
		refs[i] = &masterv1.AllocationRef{SegmentId: w.seg, AllocationId: id}
	}
	msg, err := w.s.call(func(id uint64) *masterv1.ConnectResponse {
		return &masterv1.ConnectResponse{Msg: &masterv1.ConnectResponse_Release{Release: &masterv1.ReleaseRequest{RequestId: id, Epoch: 1, Items: refs}}}
	})
	if err != nil {
		return err
	}
	for i, st := range msg.GetReleaseResult().GetItems() {
		if st.GetCode() != 0 {
			return fmt.Errorf("release item %d: %v", i, st)
		}
	}
	return nil
}
