package dataplane

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
	"github.com/crescent-kv/crescent/internal/xfer/shm"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"
)

// senv is a shared-memory listener over one shared memory segment, one
// anonymous memory segment and one disk segment, with a client.
type senv struct {
	*xenv        // reserve, item: the same token key
	shared, anon *segment.Segment
	path         string
	client       *shm.Client
}

func startShm(t testing.TB, cfg ShmConfig) *senv {
	t.Helper()
	shared, err := segment.NewSharedMemory("shm-0", 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	anon, err := segment.NewMemory("mem-0", 16<<20)
	if err != nil {
		t.Fatal(err)
	}
	disk, _, err := segment.OpenDisk(t.TempDir(), 16<<20)
	if err != nil {
		t.Fatal(err)
	}
	set := segment.NewSet(shared, anon, disk)
	keys := &Keyring{}
	key := token.SigningKey{ID: 1, Secret: token.NewKey()}
	keys.Set(tokenKeys(key))
	srv := New(Config{Transfer: TransferConfig{IOTimeout: 5 * time.Second}}, Deps{Segments: set, Keys: keys, Registerer: prometheus.NewRegistry(), Now: func() time.Time { return now }}, testutil.Logger())
	// Unix socket paths are short: not under t.TempDir's long names.
	dir, err := os.MkdirTemp("", "shm")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "agent.sock")
	lis, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	e := &senv{xenv: &xenv{mem: shared, disk: disk, keys: keys, key: key, srv: srv, cancel: cancel, done: make(chan error, 1)},
		shared: shared, anon: anon, path: path, client: shm.New(shm.Config{Path: path})}
	go func() { e.done <- srv.ServeShm(ctx, lis, cfg) }()
	t.Cleanup(func() {
		_ = e.client.Close()
		e.stop(t)
		_ = set.Close()
		_ = os.RemoveAll(dir)
	})
	return e
}

func TestShmRoundTrip(t *testing.T) {
	e := startShm(t, ShmConfig{})
	ctx := t.Context()
	if !e.client.Has(ctx, e.shared.ID()) {
		t.Fatalf("Has(shared) = false: %v", e.client.Err())
	}
	if e.client.Has(ctx, e.anon.ID()) || e.client.Has(ctx, e.disk.ID()) {
		t.Fatal("Has reports a segment that is not shared")
	}
	sizes := []int{0, 1, 4096, 1 << 20, 3<<20 + 5}
	items := make([]*agentv1.TransferItem, len(sizes))
	data := make([][]byte, len(sizes))
	ids := make([]uint64, len(sizes))
	for i, n := range sizes {
		data[i] = randBytes(n)
		ids[i] = e.reserve(t, e.shared, uint64(n))
		items[i] = e.item(e.shared, ids[i], token.Write)
	}
	errs, err := e.client.Write(ctx, items, data)
	if err != nil {
		t.Fatal(err)
	}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("write item %d: %v", i, err)
		}
		// The release was answered: the write is closed, Seal hashes the
		// bytes the client copied into its mapping.
		seal(t, e.shared, ids[i], data[i])
	}
	dst := make([][]byte, len(sizes))
	for i, n := range sizes {
		dst[i] = make([]byte, n)
		items[i] = e.item(e.shared, ids[i], token.Read)
	}
	res, err := e.client.Read(ctx, items, dst)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range res {
		if r.Err != nil || r.N != sizes[i] || r.ObjectSize != uint64(sizes[i]) || r.Checksum != checksum.Sum(data[i]) || !bytes.Equal(dst[i], data[i]) {
			t.Fatalf("read item %d: %+v, equal %v", i, r, bytes.Equal(dst[i], data[i]))
		}
	}
	// A range.
	it := e.item(e.shared, ids[3], token.Read)
	it.Offset = 100
	part := make([]byte, 1000)
	if res, err := e.client.Read(ctx, []*agentv1.TransferItem{it}, [][]byte{part}); err != nil || res[0].Err != nil || !bytes.Equal(part, data[3][100:1100]) {
		t.Fatalf("range read: %v %v", res, err)
	}
}

func TestShmChecksAsTheBulkPath(t *testing.T) {
	e := startShm(t, ShmConfig{})
	ctx := t.Context()
	data := randBytes(4096)
	id := e.reserve(t, e.shared, 4096)
	diskID := e.reserve(t, e.disk, 10)
	bad := e.item(e.shared, id, token.Write)
	bad.Token = append([]byte(nil), bad.Token...)
	bad.Token[len(bad.Token)-1] ^= 1
	readTok := e.item(e.shared, id, token.Write)
	readTok.Token = e.item(e.shared, id, token.Read).Token
	over := e.item(e.shared, id, token.Write)
	over.Offset = 1
	errs, err := e.client.Write(ctx,
		[]*agentv1.TransferItem{bad, readTok, over, e.item(e.disk, diskID, token.Write), e.item(e.shared, id, token.Write)},
		[][]byte{data, data, data, data[:10], data})
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []string{"INVALID_TOKEN", "INVALID_TOKEN", "OUT_OF_BOUNDS", "SEGMENT_NOT_FOUND", ""} {
		if got := rpcerr.Reason(errs[i]); got != want {
			t.Errorf("item %d: reason %q (%v), want %q", i, got, errs[i], want)
		}
	}
	// Seal verifies the bytes in the mapping: a wrong checksum is refused.
	if err := e.shared.Seal([]segment.SealArg{{ID: id, Checksum: checksum.Sum(data) + 1}}, now)[0]; rpcerr.Reason(err) != "CHECKSUM_MISMATCH" {
		t.Fatalf("Seal with a wrong checksum = %v", err)
	}
	// Reads need SEALED, and a read token.
	res, err := e.client.Read(ctx, []*agentv1.TransferItem{e.item(e.shared, id, token.Read), e.item(e.shared, id, token.Write)}, [][]byte{make([]byte, 4096), make([]byte, 4096)})
	if err != nil {
		t.Fatal(err)
	}
	if rpcerr.Reason(res[0].Err) == "" || rpcerr.Reason(res[1].Err) != "INVALID_TOKEN" {
		t.Fatalf("reads of a RESERVED allocation: %v, %v", res[0].Err, res[1].Err)
	}
	seal(t, e.shared, id, data)
	res, err = e.client.Read(ctx, []*agentv1.TransferItem{e.item(e.shared, id, token.Read)}, [][]byte{make([]byte, 4097)})
	if err == nil && res[0].Err == nil {
		t.Fatal("a read past the object's end succeeded")
	}
}

// rawShm is a hand-driven client connection.
type rawShm struct {
	t  *testing.T
	uc *net.UnixConn
}

func dialRaw(t *testing.T, path string) *rawShm {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	r := &rawShm{t: t, uc: c.(*net.UnixConn)}
	_ = r.uc.SetDeadline(time.Now().Add(10 * time.Second))
	return r
}

// hello sends the preamble and reads the hello, closing the descriptors.
func (r *rawShm) hello() ([]shm.Segment, error) {
	if _, err := r.uc.Write([]byte(shm.Preamble)); err != nil {
		return nil, err
	}
	buf, oob := make([]byte, 4096), make([]byte, 1024)
	n, oobn, _, _, err := r.uc.ReadMsgUnix(buf, oob)
	if err != nil {
		return nil, err
	}
	if oobn > 0 {
		msgs, _ := unixParse(oob[:oobn])
		for _, fd := range msgs {
			_ = closeFD(fd)
		}
	}
	return shm.ReadHello(io.MultiReader(bytes.NewReader(buf[:n]), r.uc))
}

func (r *rawShm) send(b []byte) {
	r.t.Helper()
	if _, err := r.uc.Write(b); err != nil {
		r.t.Fatal(err)
	}
}

func (r *rawShm) request(op agentv1.TransferOp, items ...*agentv1.TransferItem) {
	r.t.Helper()
	b, err := xfer.AppendFrame(nil, &agentv1.TransferRequest{Op: op, Items: items})
	if err != nil {
		r.t.Fatal(err)
	}
	r.send(b)
}

func (r *rawShm) grant(n int) (*agentv1.TransferResponse, []uint64, error) {
	resp := &agentv1.TransferResponse{}
	offs, _, err := shm.ReadGrant(r.uc, nil, resp, n, nil)
	return resp, offs, err
}

func TestShmGrantHoldsTheAllocation(t *testing.T) {
	e := startShm(t, ShmConfig{IOTimeout: 300 * time.Millisecond})
	r := dialRaw(t, e.path)
	if _, err := r.hello(); err != nil {
		t.Fatal(err)
	}
	id := e.reserve(t, e.shared, 100)
	it := e.item(e.shared, id, token.Write)
	it.Length = 100
	r.request(agentv1.TransferOp_TRANSFER_OP_WRITE, it)
	if resp, _, err := r.grant(1); err != nil || resp.GetResults()[0].GetStatus() != nil {
		t.Fatalf("grant = %v, %v", resp, err)
	}
	// Granted and not released: the write is open, Seal must wait.
	if err := e.shared.Seal([]segment.SealArg{{ID: id, Checksum: checksum.Sum(make([]byte, 100))}}, now)[0]; err == nil {
		t.Fatal("Seal during a write grant succeeded")
	}
	// No release within IOTimeout: the agent ends the connection and the
	// allocation is closed.
	var b [1]byte
	if _, err := r.uc.Read(b[:]); !errors.Is(err, io.EOF) {
		t.Fatalf("read after the grant's timeout = %v, want EOF", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := e.shared.Seal([]segment.SealArg{{ID: id, Checksum: checksum.Sum(make([]byte, 100))}}, now)[0]
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Seal after the grant timed out: %v", err)
		}
		time.Sleep(10 * time.Millisecond) // the connection's goroutine closes the handle after the EOF we saw
	}
}

func TestShmHostilePeers(t *testing.T) {
	e := startShm(t, ShmConfig{})
	id := e.reserve(t, e.shared, 100)
	t.Run("release without a grant", func(t *testing.T) {
		r := dialRaw(t, e.path)
		if _, err := r.hello(); err != nil {
			t.Fatal(err)
		}
		r.send(shm.Release)
		if _, _, err := r.grant(1); rpcerr.Reason(err) != "INVALID_PARAMS" {
			t.Fatalf("answer = %v", err)
		}
	})
	t.Run("request before the release", func(t *testing.T) {
		r := dialRaw(t, e.path)
		if _, err := r.hello(); err != nil {
			t.Fatal(err)
		}
		it := e.item(e.shared, id, token.Write)
		it.Length = 100
		r.request(agentv1.TransferOp_TRANSFER_OP_WRITE, it)
		if _, _, err := r.grant(1); err != nil {
			t.Fatal(err)
		}
		r.request(agentv1.TransferOp_TRANSFER_OP_WRITE, it)
		if _, _, err := r.grant(1); rpcerr.Reason(err) != "INVALID_PARAMS" {
			t.Fatalf("answer = %v", err)
		}
	})
	t.Run("bad preamble", func(t *testing.T) {
		r := dialRaw(t, e.path)
		r.send([]byte("CXF1"))
		if _, err := shm.ReadHello(r.uc); rpcerr.Reason(err) != "INVALID_PARAMS" {
			t.Fatalf("answer = %v", err)
		}
	})
	t.Run("oversized header", func(t *testing.T) {
		r := dialRaw(t, e.path)
		if _, err := r.hello(); err != nil {
			t.Fatal(err)
		}
		var b [4]byte
		binary.LittleEndian.PutUint32(b[:], xfer.MaxHeaderBytes+1)
		r.send(b[:])
		if _, _, err := r.grant(1); rpcerr.Reason(err) != "INVALID_PARAMS" {
			t.Fatalf("answer = %v", err)
		}
	})
	t.Run("no items", func(t *testing.T) {
		r := dialRaw(t, e.path)
		if _, err := r.hello(); err != nil {
			t.Fatal(err)
		}
		r.request(agentv1.TransferOp_TRANSFER_OP_READ)
		if _, _, err := r.grant(0); rpcerr.Reason(err) != "INVALID_PARAMS" {
			t.Fatalf("answer = %v", err)
		}
	})
}

func TestShmPeerCheck(t *testing.T) {
	other := uint32(os.Getuid()) + 1
	e := startShm(t, ShmConfig{ownUID: &other})
	r := dialRaw(t, e.path)
	if _, err := r.hello(); err == nil || !bytes.Contains([]byte(err.Error()), []byte("may not map")) {
		t.Fatalf("hello of a refused peer = %v", err)
	}
	// The client learns nothing, remembers the failure, and does not try
	// again within RetryAfter.
	if e.client.Has(t.Context(), e.shared.ID()) || e.client.Err() == nil {
		t.Fatalf("Has after a refused peer check: err %v", e.client.Err())
	}
	// Allowed by uid.
	self := uint32(os.Getuid())
	e2 := startShm(t, ShmConfig{ownUID: &other, AllowUIDs: []uint32{self}})
	if !e2.client.Has(t.Context(), e2.shared.ID()) {
		t.Fatalf("Has with the uid allowed: %v", e2.client.Err())
	}
}

func TestShmConnectionLimits(t *testing.T) {
	e := startShm(t, ShmConfig{MaxConns: 2, MaxConnsPerPeer: 1})
	r := dialRaw(t, e.path)
	if _, err := r.hello(); err != nil {
		t.Fatal(err)
	}
	r2 := dialRaw(t, e.path)
	if _, err := r2.hello(); rpcerr.Reason(err) != "LIMIT_EXCEEDED" {
		t.Fatalf("second connection of one process: %v", err)
	}
}

func TestShmAbsentSocket(t *testing.T) {
	c := shm.New(shm.Config{Path: filepath.Join(os.TempDir(), "no-such-crescent.sock")})
	defer c.Close()
	if c.Has(t.Context(), "seg") {
		t.Fatal("Has on an absent socket")
	}
	if rpcerr.Reason(c.Err()) != "AGENT_UNAVAILABLE" {
		t.Fatalf("Err = %v", c.Err())
	}
	if _, err := c.Read(t.Context(), []*agentv1.TransferItem{{SegmentId: "seg"}}, [][]byte{make([]byte, 1)}); err == nil {
		t.Fatal("Read on an absent socket")
	}
}

func unixParse(oob []byte) ([]int, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	var fds []int
	for _, m := range msgs {
		f, err := unix.ParseUnixRights(&m)
		if err == nil {
			fds = append(fds, f...)
		}
	}
	return fds, nil
}

func closeFD(fd int) error { return unix.Close(fd) }

// FuzzShmRequests sends arbitrary bytes after the hello to a real
// shared-memory listener: whatever they are, the agent answers or closes
// the connection within its I/O timeout and never panics (the race
// detector and goleak watch the rest).
func FuzzShmRequests(f *testing.F) {
	e := startShm(f, ShmConfig{IOTimeout: 200 * time.Millisecond})
	id := e.reserve(f, e.shared, 64)
	it := e.item(e.shared, id, token.Write)
	it.Length = 64
	req, _ := xfer.AppendFrame(nil, &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE, Items: []*agentv1.TransferItem{it}})
	f.Add(append(append([]byte{}, req...), shm.Release...))
	f.Add(req)
	f.Add(shm.Release)
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := net.Dial("unix", e.path)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		uc := c.(*net.UnixConn)
		_ = uc.SetDeadline(time.Now().Add(5 * time.Second))
		r := &rawShm{t: t, uc: uc}
		if _, err := r.hello(); err != nil {
			t.Fatal(err)
		}
		_, _ = uc.Write(b)
		_ = uc.CloseWrite()
		_, _ = io.Copy(io.Discard, uc) // until the agent closes
	})
}
