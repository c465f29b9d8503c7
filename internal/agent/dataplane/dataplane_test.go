package dataplane

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"testing"
	"time"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/checksum"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/testutil"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var now = time.UnixMilli(1_700_000_000_000)

type env struct {
	mem, disk *segment.Segment
	keys      *Keyring
	key       token.SigningKey
	client    agentv1.DataServiceClient
	srv       *Server
}

// newTestServer builds a Server over one 64 MiB memory and one 64 MiB disk
// segment, with a fresh token key and the test clock.
func newTestServer(t testing.TB, cfg Config) (mem, disk *segment.Segment, set *segment.Set, keys *Keyring, key token.SigningKey, srv *Server) {
	t.Helper()
	mem, err := segment.NewMemory("mem-0", 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	disk, _, err = segment.OpenDisk(t.TempDir(), 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	set = segment.NewSet(mem, disk)
	keys = &Keyring{}
	key = token.SigningKey{ID: 1, Secret: token.NewKey()}
	keys.Set(tokenKeys(key))
	srv = New(cfg, Deps{Segments: set, Keys: keys, Registerer: prometheus.NewRegistry(), Now: func() time.Time { return now }}, testutil.Logger())
	return mem, disk, set, keys, key, srv
}

// start serves a DataService over bufconn with one memory and one disk
// segment and returns a real generated client.
func start(t *testing.T, opts ...grpc.ServerOption) *env {
	t.Helper()
	if opts == nil {
		opts = ServerOptions()
	}
	mem, disk, set, keys, key, srv := newTestServer(t, Config{})

	lis := bufconn.Listen(1 << 20)
	gs := grpc.NewServer(append([]grpc.ServerOption{grpc.MaxRecvMsgSize(256 << 20), grpc.MaxSendMsgSize(256 << 20)}, opts...)...)
	agentv1.RegisterDataServiceServer(gs, srv)
	go func() { _ = gs.Serve(lis) }()
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(256<<20), grpc.MaxCallSendMsgSize(256<<20)),
	)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		gs.Stop()
		_ = set.Close()
	})
	return &env{mem: mem, disk: disk, keys: keys, key: key, client: agentv1.NewDataServiceClient(conn), srv: srv}
}

func (e *env) reserve(t *testing.T, seg *segment.Segment, size uint64) uint64 {
	t.Helper()
	a, err := seg.Reserve(&masterv1.ReserveItem{SegmentId: seg.ID(), Size: size, Tenant: "t", Key: "k"}, now)
	if err != nil {
		t.Fatal(err)
	}
	return a.GetAllocationId()
}

func (e *env) tok(seg *segment.Segment, id uint64, mode token.Mode) []byte {
	return token.Sign(e.key, token.Claims{Mode: mode, Tenant: "t", Key: "k", SegmentID: seg.ID(), AllocationID: id, Expiry: now.Add(time.Minute)})
}

// write streams data in chunk-sized messages.
func (e *env) write(ctx context.Context, hdr *agentv1.WriteHeader, data []byte, chunk int) (uint64, error) {
	st, err := e.client.Write(ctx)
	if err != nil {
		return 0, err
	}
	first := true
	for off := 0; first || off < len(data); off += chunk {
		m := &agentv1.WriteRequest{Data: data[off:min(off+chunk, len(data))]}
		if first {
			m.Header = hdr
			first = false
		}
		if err := st.Send(m); err != nil {
			break // the status comes from CloseAndRecv
		}
	}
	resp, err := st.CloseAndRecv()
	return resp.GetBytesWritten(), err
}

func (e *env) read(ctx context.Context, req *agentv1.ReadRequest) ([]byte, *agentv1.ReadResponse, int, error) {
	st, err := e.client.Read(ctx, req)
	if err != nil {
		return nil, nil, 0, err
	}
	var out []byte
	var first *agentv1.ReadResponse
	msgs := 0
	for {
		m, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return out, first, msgs, nil
		}
		if err != nil {
			return nil, nil, 0, err
		}
		if first == nil {
			first = m
		}
		msgs++
		out = append(out, m.GetData()...)
	}
}

func randBytes(n int) []byte {
	r := rand.New(rand.NewPCG(uint64(n), 7))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func wantErr(t *testing.T, err error, code codes.Code, reason string) {
	t.Helper()
	if got := status.Code(err); got != code || rpcerr.Reason(err) != reason {
		t.Fatalf("err = %v (code %v reason %q), want %v %s", err, got, rpcerr.Reason(err), code, reason)
	}
}

func TestWriteSealReadRoundTrip(t *testing.T) {
	t.Run("codec=dataplane", func(t *testing.T) { testRoundTrip(t, start(t)) })
	// Registered on a server without the data plane codec, the service
	// still works (the standard codec copies).
	t.Run("codec=standard", func(t *testing.T) { testRoundTrip(t, start(t, grpc.EmptyServerOption{})) })
}

func testRoundTrip(t *testing.T, e *env) {
	ctx := t.Context()
	for _, tc := range []struct {
		name string
		seg  func() *segment.Segment
		size int
	}{
		{"memory small", func() *segment.Segment { return e.mem }, 100},
		{"memory chunked", func() *segment.Segment { return e.mem }, 5<<20 + 17},
		{"disk chunked", func() *segment.Segment { return e.disk }, 3<<20 + 5},
		{"empty object", func() *segment.Segment { return e.mem }, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			seg := tc.seg()
			data := randBytes(tc.size)
			id := e.reserve(t, seg, uint64(len(data)))
			n, err := e.write(ctx, &agentv1.WriteHeader{SegmentId: seg.ID(), AllocationId: id, Token: e.tok(seg, id, token.Write)}, data, 1<<20)
			if err != nil || n != uint64(len(data)) {
				t.Fatalf("Write = %d, %v; want %d bytes", n, err, len(data))
			}
			if err := seg.Seal([]segment.SealArg{{ID: id, Checksum: checksum.Sum(data)}}, now)[0]; err != nil {
				t.Fatalf("Seal: %v", err)
			}
			got, first, msgs, err := e.read(ctx, &agentv1.ReadRequest{SegmentId: seg.ID(), AllocationId: id, Token: e.tok(seg, id, token.Read)})
			if err != nil {
				t.Fatalf("Read: %v", err)
			}
			if !bytes.Equal(got, data) {
				t.Fatalf("read %d bytes that differ from the %d written", len(got), len(data))
			}
			if first.GetObjectSize() != uint64(len(data)) || first.GetChecksum() != checksum.Sum(data) {
				t.Fatalf("first message size %d checksum %#x, want %d %#x", first.GetObjectSize(), first.GetChecksum(), len(data), checksum.Sum(data))
			}
			if want := max(1, (len(data)+DefaultChunkSize-1)/DefaultChunkSize); msgs != want {
				t.Fatalf("read in %d messages, want %d", msgs, want)
			}
			// A range with a chosen chunk size.
			if len(data) > 1000 {
				got, _, msgs, err := e.read(ctx, &agentv1.ReadRequest{SegmentId: seg.ID(), AllocationId: id, Token: e.tok(seg, id, token.Read), Offset: 10, Length: 1000, ChunkSize: 300})
				if err != nil || !bytes.Equal(got, data[10:1010]) || msgs != 4 {
					t.Fatalf("range read: %d bytes in %d messages, err %v", len(got), msgs, err)
				}
			}
		})
	}
}

func TestWriteAtHeaderOffset(t *testing.T) {
	e := start(t)
	data := randBytes(1000)
	id := e.reserve(t, e.mem, 1000)
	hdr := func(off uint64) *agentv1.WriteHeader {
		return &agentv1.WriteHeader{SegmentId: e.mem.ID(), AllocationId: id, Token: e.tok(e.mem, id, token.Write), Offset: off}
	}
	if _, err := e.write(t.Context(), hdr(0), data[:400], 100); err != nil {
		t.Fatal(err)
	}
	if _, err := e.write(t.Context(), hdr(400), data[400:], 100); err != nil {
		t.Fatal(err)
	}
	if err := e.mem.Seal([]segment.SealArg{{ID: id, Checksum: checksum.Sum(data)}}, now)[0]; err != nil {
		t.Fatalf("Seal after two ranged writes: %v", err)
	}
}

func TestTokensAndStatesEnforced(t *testing.T) {
	e := start(t)
	ctx := t.Context()
	reserved := e.reserve(t, e.mem, 100)
	sealed := e.reserve(t, e.mem, 100)
	if err := e.mem.Seal([]segment.SealArg{{ID: sealed, Checksum: checksum.Sum(make([]byte, 100))}}, now)[0]; err != nil {
		t.Fatal(err)
	}
	seg := e.mem.ID()
	otherKey := token.SigningKey{ID: e.key.ID, Secret: token.NewKey()}
	expired := token.Sign(e.key, token.Claims{Mode: token.Write, Tenant: "t", Key: "k", SegmentID: seg, AllocationID: reserved, Expiry: now.Add(-time.Second)})
	forged := token.Sign(otherKey, token.Claims{Mode: token.Write, Tenant: "t", Key: "k", SegmentID: seg, AllocationID: reserved, Expiry: now.Add(time.Minute)})
	writeTests := []struct {
		name   string
		hdr    *agentv1.WriteHeader
		data   []byte
		code   codes.Code
		reason string
	}{
		{"no header", nil, []byte("x"), codes.InvalidArgument, "INVALID_PARAMS"},
		{"no token", &agentv1.WriteHeader{SegmentId: seg, AllocationId: reserved}, []byte("x"), codes.PermissionDenied, "INVALID_TOKEN"},
		{"forged token", &agentv1.WriteHeader{SegmentId: seg, AllocationId: reserved, Token: forged}, []byte("x"), codes.PermissionDenied, "INVALID_TOKEN"},
		{"garbage token", &agentv1.WriteHeader{SegmentId: seg, AllocationId: reserved, Token: []byte("hello")}, []byte("x"), codes.PermissionDenied, "INVALID_TOKEN"},
		{"expired token", &agentv1.WriteHeader{SegmentId: seg, AllocationId: reserved, Token: expired}, []byte("x"), codes.PermissionDenied, "INVALID_TOKEN"},
		{"read token", &agentv1.WriteHeader{SegmentId: seg, AllocationId: reserved, Token: e.tok(e.mem, reserved, token.Read)}, []byte("x"), codes.PermissionDenied, "INVALID_TOKEN"},
		{"token for another allocation", &agentv1.WriteHeader{SegmentId: seg, AllocationId: reserved, Token: e.tok(e.mem, sealed, token.Write)}, []byte("x"), codes.PermissionDenied, "INVALID_TOKEN"},
		{"out of bounds", &agentv1.WriteHeader{SegmentId: seg, AllocationId: reserved, Token: e.tok(e.mem, reserved, token.Write)}, make([]byte, 101), codes.OutOfRange, "OUT_OF_BOUNDS"},
		{"out of bounds by offset", &agentv1.WriteHeader{SegmentId: seg, AllocationId: reserved, Token: e.tok(e.mem, reserved, token.Write), Offset: 99}, make([]byte, 2), codes.OutOfRange, "OUT_OF_BOUNDS"},
		{"write after seal", &agentv1.WriteHeader{SegmentId: seg, AllocationId: sealed, Token: e.tok(e.mem, sealed, token.Write)}, []byte("x"), codes.FailedPrecondition, "ALLOCATION_STATE"},
		{"unknown allocation", &agentv1.WriteHeader{SegmentId: seg, AllocationId: 999, Token: e.tok(e.mem, 999, token.Write)}, []byte("x"), codes.NotFound, "ALLOCATION_NOT_FOUND"},
		{"unknown segment", &agentv1.WriteHeader{SegmentId: "nope", AllocationId: 1, Token: token.Sign(e.key, token.Claims{Mode: token.Write, SegmentID: "nope", AllocationID: 1, Expiry: now.Add(time.Minute)})}, []byte("x"), codes.NotFound, "SEGMENT_NOT_FOUND"},
	}
	for _, tc := range writeTests {
		t.Run("write/"+tc.name, func(t *testing.T) {
			_, err := e.write(ctx, tc.hdr, tc.data, 1<<20)
			wantErr(t, err, tc.code, tc.reason)
		})
	}
	t.Run("write/empty stream", func(t *testing.T) {
		st, err := e.client.Write(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, err = st.CloseAndRecv()
		wantErr(t, err, codes.InvalidArgument, "INVALID_PARAMS")
	})

	readTests := []struct {
		name   string
		req    *agentv1.ReadRequest
		code   codes.Code
		reason string
	}{
		{"read of reserved", &agentv1.ReadRequest{SegmentId: seg, AllocationId: reserved, Token: e.tok(e.mem, reserved, token.Read)}, codes.FailedPrecondition, "ALLOCATION_STATE"},
		{"no token", &agentv1.ReadRequest{SegmentId: seg, AllocationId: sealed}, codes.PermissionDenied, "INVALID_TOKEN"},
		{"write token", &agentv1.ReadRequest{SegmentId: seg, AllocationId: sealed, Token: e.tok(e.mem, sealed, token.Write)}, codes.PermissionDenied, "INVALID_TOKEN"},
		{"offset past end", &agentv1.ReadRequest{SegmentId: seg, AllocationId: sealed, Token: e.tok(e.mem, sealed, token.Read), Offset: 101}, codes.OutOfRange, "OUT_OF_BOUNDS"},
		{"range past end", &agentv1.ReadRequest{SegmentId: seg, AllocationId: sealed, Token: e.tok(e.mem, sealed, token.Read), Offset: 50, Length: 51}, codes.OutOfRange, "OUT_OF_BOUNDS"},
	}
	for _, tc := range readTests {
		t.Run("read/"+tc.name, func(t *testing.T) {
			_, _, _, err := e.read(ctx, tc.req)
			wantErr(t, err, tc.code, tc.reason)
		})
	}

	t.Run("no key yet", func(t *testing.T) {
		e.keys.Set(nil)
		defer e.keys.Set(tokenKeys(e.key))
		_, err := e.write(ctx, &agentv1.WriteHeader{SegmentId: seg, AllocationId: reserved, Token: e.tok(e.mem, reserved, token.Write)}, []byte("x"), 10)
		wantErr(t, err, codes.PermissionDenied, "INVALID_TOKEN")
	})
}

func TestBatchWriteRead(t *testing.T) {
	e := start(t)
	ctx := t.Context()
	var items []*agentv1.BatchWriteItem
	var datas [][]byte
	var ids []uint64
	for i, seg := range []*segment.Segment{e.mem, e.disk, e.mem} {
		data := randBytes(1000 + i)
		id := e.reserve(t, seg, uint64(len(data)))
		ids = append(ids, id)
		datas = append(datas, data)
		items = append(items, &agentv1.BatchWriteItem{SegmentId: seg.ID(), AllocationId: id, Token: e.tok(seg, id, token.Write), Data: data})
	}
	items = append(items,
		&agentv1.BatchWriteItem{SegmentId: e.mem.ID(), AllocationId: ids[0], Data: []byte("x")},
		&agentv1.BatchWriteItem{SegmentId: e.mem.ID(), AllocationId: ids[2], Token: e.tok(e.mem, ids[2], token.Write), Data: make([]byte, 2000)},
	)
	resp, err := e.client.BatchWrite(ctx, &agentv1.BatchWriteRequest{Items: items})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"", "", "", "INVALID_TOKEN", "OUT_OF_BOUNDS"}
	for i, r := range resp.GetResults() {
		if r.GetReason() != want[i] || (want[i] == "") != (r.GetCode() == 0) {
			t.Fatalf("item %d = %v, want reason %q", i, r, want[i])
		}
	}
	segs := []*segment.Segment{e.mem, e.disk, e.mem}
	for i, seg := range segs[:2] {
		if err := seg.Seal([]segment.SealArg{{ID: ids[i], Checksum: checksum.Sum(datas[i])}}, now)[0]; err != nil {
			t.Fatalf("Seal %d: %v", i, err)
		}
	}
	rresp, err := e.client.BatchRead(ctx, &agentv1.BatchReadRequest{Items: []*agentv1.BatchReadItem{
		{SegmentId: e.mem.ID(), AllocationId: ids[0], Token: e.tok(e.mem, ids[0], token.Read)},
		{SegmentId: e.disk.ID(), AllocationId: ids[1], Token: e.tok(e.disk, ids[1], token.Read)},
		{SegmentId: e.mem.ID(), AllocationId: ids[2], Token: e.tok(e.mem, ids[2], token.Read)},
	}})
	if err != nil {
		t.Fatal(err)
	}
	r := rresp.GetResults()
	for i := range 2 {
		if r[i].GetStatus().GetCode() != 0 || !bytes.Equal(r[i].GetData(), datas[i]) || r[i].GetChecksum() != checksum.Sum(datas[i]) {
			t.Fatalf("batch read %d = status %v, %d bytes", i, r[i].GetStatus(), len(r[i].GetData()))
		}
	}
	if r[2].GetStatus().GetReason() != "ALLOCATION_STATE" || len(r[2].GetData()) != 0 {
		t.Fatalf("batch read of a reserved allocation = %v, want ALLOCATION_STATE", r[2].GetStatus())
	}
}
