// Package dataplane serves DataService: clients write the bytes of RESERVED
// allocations and read SEALED ones, each call carrying a token the master
// signed (internal/token) under one of the keys its latest Settings sent
// this agent (the current and the previous one). The token must name this
// allocation, the operation, the object the allocation holds (tenant and
// key, as its Reserve named them) and, when the caller is a tenant
// principal, the caller's tenant. A blank reservation (reserved with no
// object) holds the object of the first write token that opens it: the
// write records the token's tenant, key, replica id, group and hard pin
// before any byte lands, and later tokens must name the same object.
//
// A spare (a blank the master leased to a client ahead of its puts) has a
// write token with the spare flag, which names the tenant and replica id
// but no key: only the bulk transfer listener writes one, binding it to
// the token's tenant and the key its item names (TransferItem.key), and it
// seals the write with a seal receipt bound to that object (version 2).
// The other write paths carry no key and refuse a spare's token.
//
// The hot path copies as little as it can: a Write copies each received
// message's data straight into the segment (memory: the mapping; disk:
// pwrite), a Read of a memory segment sends slices of the mapping itself (the
// only copy is gRPC's encoding into the transport), a Read of a disk segment
// preads into one buffer reused for the whole stream. Nothing buffers a whole
// object: streams move chunks of at most ChunkSize.
//
// The same Server also speaks the bulk transfer protocol (internal/xfer) on a
// listener of its own (ServeTransfer, transfer.go): the same tokens, checks
// and metrics, without gRPC's framing, so payloads move between the socket
// and a memory segment's mapping with no user-space copy.
package dataplane

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"
	"unsafe"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/agent/segment"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/token"
	"github.com/crescent-kv/crescent/internal/xfer"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/status"
)

// Defaults for Config.
const (
	DefaultChunkSize = 1 << 20
	// MaxChunkSize bounds a client's ReadRequest.chunk_size: well under the
	// 256 MiB message limit of internal/server.
	MaxChunkSize = 64 << 20
	// MaxBatchReadBytes bounds the data of one BatchRead response.
	MaxBatchReadBytes = 192 << 20
	// MaxSpareKeyLen bounds the key a spare's write names
	// (TransferItem.key), in bytes.
	MaxSpareKeyLen = 1024
)

// Config tunes the data plane.
type Config struct {
	// ChunkSize is the Read chunk when the client does not choose one.
	ChunkSize int
	// Transfer tunes the bulk transfer listener (ServeTransfer).
	Transfer TransferConfig
}

// Keyring holds a token.Verifier for the keys of the master's latest
// Settings: tokens under those keys are accepted, under any other key
// refused (a key leaves when the master has rotated twice since it signed).
type Keyring struct {
	// mu serialises Set; verifier loads v without it.
	mu sync.Mutex
	v  atomic.Pointer[token.Verifier]
	// rk signs seal receipts under the receipt key of the newest key.
	rk atomic.Pointer[token.ReceiptKeys]
}

// Set installs the keys of a Settings message, replacing the previous set.
// Keys with an empty secret are skipped (an empty HMAC key would let anyone
// forge tokens); no keys at all clears the ring. Keys the ring already
// holds keep their pooled HMAC states. The Verifier copies the secrets.
func (k *Keyring) Set(keys []*masterv1.TokenKey) {
	ks := make([]token.SigningKey, 0, len(keys))
	for _, tk := range keys {
		if len(tk.GetKey()) > 0 {
			ks = append(ks, token.SigningKey{ID: tk.GetId(), Secret: tk.GetKey()})
		}
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(ks) == 0 {
		k.v.Store(nil)
		k.rk.Store(nil)
		return
	}
	k.v.Store(k.v.Load().Rekey(ks...))
	k.rk.Store(token.NewReceiptKeys(ks[0]))
}

// receipts returns the receipt keys of the newest key, or nil before the
// first Settings.
func (k *Keyring) receipts() *token.ReceiptKeys { return k.rk.Load() }

// KeyIDs lists the ids of the keys accepted now, newest first.
func (k *Keyring) KeyIDs() []uint32 {
	if v := k.v.Load(); v != nil {
		return v.KeyIDs()
	}
	return nil
}

// verifier returns the Verifier of the current keys, or nil before the
// first Settings.
func (k *Keyring) verifier() *token.Verifier { return k.v.Load() }

// Deps are the data plane's collaborators.
type Deps struct {
	Segments *segment.Set
	Keys     *Keyring
	// Registerer receives the data plane metrics; nil skips them.
	Registerer prometheus.Registerer
	// Now is the clock for token expiry; nil means time.Now.
	Now func() time.Time
}

// Server implements agentv1.DataServiceServer.
type Server struct {
	agentv1.UnimplementedDataServiceServer

	cfg  Config
	segs *segment.Set
	keys *Keyring
	now  func() time.Time
	lg   *slog.Logger

	bytesIn, bytesOut prometheus.Counter
	errs              *prometheus.CounterVec
	// Bulk transfer listener: open connections and requests in progress.
	xferConns, xferBusy prometheus.Gauge
	// Bulk transfer connections refused at accept, by the limit reached.
	xferRefused *prometheus.CounterVec
	// Items of the bulk transfer requests being served.
	xferItems prometheus.Gauge
	// Allocations sealed on write (seal_checksum), with a seal receipt.
	sealsOnWrite prometheus.Counter
	// Items granted on the shared-memory socket, by op (read, write).
	shmItems *prometheus.CounterVec
	// verify bounds the work of VERIFY requests (transfer_verify.go).
	verify *verifier
}

// New builds the server; it does no I/O.
func New(cfg Config, deps Deps, lg *slog.Logger) *Server {
	if cfg.ChunkSize <= 0 {
		cfg.ChunkSize = DefaultChunkSize
	}
	cfg.ChunkSize = min(cfg.ChunkSize, MaxChunkSize)
	cfg.Transfer = cfg.Transfer.withDefaults()
	s := &Server{
		cfg: cfg, segs: deps.Segments, keys: deps.Keys, now: deps.Now, lg: lg, verify: newVerifier(),
		bytesIn:   prometheus.NewCounter(prometheus.CounterOpts{Name: "crescent_agent_data_bytes_in_total", Help: "Object bytes written into segments by DataService and the bulk transfer listener."}),
		bytesOut:  prometheus.NewCounter(prometheus.CounterOpts{Name: "crescent_agent_data_bytes_out_total", Help: "Object bytes read out of segments by DataService and the bulk transfer listener."}),
		errs:      prometheus.NewCounterVec(prometheus.CounterOpts{Name: "crescent_agent_data_errors_total", Help: "DataService operations refused, by method and reason."}, []string{"method", "reason"}),
		xferConns: prometheus.NewGauge(prometheus.GaugeOpts{Name: "crescent_agent_transfer_connections", Help: "Open connections of the bulk transfer listener."}),
		xferBusy:  prometheus.NewGauge(prometheus.GaugeOpts{Name: "crescent_agent_transfer_requests_in_flight", Help: "Bulk transfer requests being served."}),
		xferRefused: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "crescent_agent_transfer_connections_refused_total",
			Help: "Bulk transfer connections refused at accept, by limit (max_connections, max_connections_per_ip)."}, []string{"limit"}),
		xferItems: prometheus.NewGauge(prometheus.GaugeOpts{Name: "crescent_agent_transfer_items_in_flight", Help: "Items of the bulk transfer requests being served (bounded by --transfer-max-items-in-flight)."}),
		sealsOnWrite: prometheus.NewCounter(prometheus.CounterOpts{Name: "crescent_agent_transfer_seals_on_write_total",
			Help: "Allocations the bulk transfer listener or the shared-memory socket sealed as their write completed, answering a seal receipt (issue 18 item 2)."}),
		shmItems: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "crescent_agent_shm_items_total",
			Help: "Items the shared-memory socket granted, by op (read, write); reads a client copies straight from its mapping are not asked for and not counted (issue 18 item 3)."}, []string{"op"}),
	}
	if s.now == nil {
		s.now = time.Now
	}
	if s.keys == nil {
		s.keys = &Keyring{}
	}
	if deps.Registerer != nil {
		deps.Registerer.MustRegister(s.bytesIn, s.bytesOut, s.errs, s.xferConns, s.xferBusy, s.xferRefused, s.xferItems, s.sealsOnWrite, s.shmItems)
	}
	return s
}

func errInvalid(format string, args ...any) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, format, args...)
}

func errToken(format string, args ...any) error {
	return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_TOKEN, format, args...)
}

// open checks the token, then opens the allocation for mode: a read when
// the allocation holds the token's object, a write as openWriteTo does.
// callerTenant is check's.
func (s *Server) open(segID string, allocID uint64, tok []byte, mode token.Mode, callerTenant string) (*segment.Handle, error) {
	if mode == token.Write {
		h := new(segment.Handle)
		if err := s.openWriteTo(h, segID, allocID, tok, s.now(), callerTenant); err != nil {
			return nil, err
		}
		return h, nil
	}
	seg, obj, err := s.check(segID, allocID, tok, mode, s.now(), callerTenant)
	if err != nil {
		return nil, err
	}
	h, err := seg.OpenRead(allocID)
	if err != nil {
		return nil, err
	}
	if err := checkObject(h, obj, allocID); err != nil {
		h.Close()
		return nil, err
	}
	return h, nil
}

// openWriteTo checks the write token at now and opens the allocation for
// writing into h (segment.OpenWriteAs) as the object and replica the token
// names: a blank reservation is bound to them as it opens, before any byte
// lands; any other allocation must hold the token's object. A spare's
// token is refused (INVALID_TOKEN): its object's key is named by a bulk
// transfer item (openItemWrite), and these callers have none.
func (s *Server) openWriteTo(h *segment.Handle, segID string, allocID uint64, tok []byte, now time.Time, callerTenant string) error {
	seg, obj, err := s.check(segID, allocID, tok, token.Write, now, callerTenant)
	if err != nil {
		return err
	}
	if obj.Spare {
		return errToken("the token of allocation %d is a spare's: a spare is written over the bulk transfer listener, which names the key", allocID)
	}
	return seg.OpenWriteAs(h, allocID, segment.Identity{Tenant: obj.Tenant, Key: obj.Key, Group: obj.Group, ReplicaID: obj.ReplicaID, HardPin: obj.HardPin}, now)
}

// openItemWrite is openWriteTo for a bulk transfer WRITE item, which may
// write a spare: with a spare's token the item must name its object's key
// (non-empty, at most MaxSpareKeyLen bytes of UTF-8) and carry
// seal_checksum (a spare's write is sealed on write, its receipt bound to
// the object), and the allocation is opened as the token's tenant, the
// item's key and the token's replica id (no group, no hard pin). Any other
// token's item must name no key. Both refusals are INVALID_PARAMS.
func (s *Server) openItemWrite(h *segment.Handle, it *agentv1.TransferItem, now time.Time, callerTenant string) error {
	allocID := it.GetAllocationId()
	seg, obj, err := s.check(it.GetSegmentId(), allocID, it.GetToken(), token.Write, now, callerTenant)
	if err != nil {
		return err
	}
	key := it.GetKey()
	if !obj.Spare {
		if key != "" {
			return errInvalid("item of allocation %d names a key, but its token is not a spare's: key is only for a spare's write", allocID)
		}
		return seg.OpenWriteAs(h, allocID, segment.Identity{Tenant: obj.Tenant, Key: obj.Key, Group: obj.Group, ReplicaID: obj.ReplicaID, HardPin: obj.HardPin}, now)
	}
	switch {
	case key == "":
		return errInvalid("the token of allocation %d is a spare's: its item must name the object's key", allocID)
	case len(key) > MaxSpareKeyLen:
		return errInvalid("item of spare allocation %d names a key of %d bytes: at most %d", allocID, len(key), MaxSpareKeyLen)
	case !utf8.ValidString(key):
		return errInvalid("item of spare allocation %d names a key that is not valid UTF-8", allocID)
	case it.SealChecksum == nil:
		return errInvalid("spare allocation %d is sealed on write: its item must carry seal_checksum", allocID)
	}
	// A view of the key (which points into the request header): the
	// segment compares it, or copies it when it binds the spare.
	return seg.OpenWriteAs(h, allocID, segment.Identity{Tenant: obj.Tenant, Key: unsafe.Slice(unsafe.StringData(key), len(key)), ReplicaID: obj.ReplicaID}, now)
}

// checkObject refuses a read token for another object than the one the
// open allocation holds (writes compare as they open, OpenWriteAs).
func checkObject(h *segment.Handle, obj token.Object, allocID uint64) error {
	if tenant, key := h.Object(); !obj.Is(tenant, key) {
		return errToken("token names object %q/%q; allocation %d holds another", obj.Tenant, obj.Key, allocID)
	}
	return nil
}

// check verifies that tok allows mode on the allocation at now and returns
// its segment and the object the token names. callerTenant is the caller's
// tenant when the caller is a tenant principal, which must be the token's;
// "" (not known, or not a tenant principal) skips that comparison.
func (s *Server) check(segID string, allocID uint64, tok []byte, mode token.Mode, now time.Time, callerTenant string) (*segment.Segment, token.Object, error) {
	v := s.keys.verifier()
	if v == nil {
		return nil, token.Object{}, errToken("agent has no token key yet (not registered with a master)")
	}
	if len(tok) == 0 {
		return nil, token.Object{}, errToken("missing token")
	}
	obj, err := v.Verify(tok, token.Request{Mode: mode, SegmentID: segID, AllocationID: allocID, CallerTenant: callerTenant}, now)
	if err != nil {
		switch {
		case errors.Is(err, token.ErrExpired):
			return nil, obj, errToken("token expired")
		case errors.Is(err, token.ErrMismatch):
			return nil, obj, errToken("token is not a %s token for allocation %d of segment %s", modeName(mode), allocID, segID)
		case errors.Is(err, token.ErrTenant):
			return nil, obj, errToken("token is for another tenant than the caller's (%q)", callerTenant)
		case errors.Is(err, token.ErrUnknownKey):
			return nil, obj, errToken("token signed by an unknown key (this agent accepts key ids %v): "+
				"older than two key rotations, or from another master", v.KeyIDs())
		default:
			return nil, obj, errToken("token rejected: %v", err)
		}
	}
	seg, ok := s.segs.Get(segID)
	if !ok {
		return nil, obj, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "no segment %q at this agent", segID)
	}
	return seg, obj, nil
}

func modeName(m token.Mode) string {
	if m == token.Write {
		return "write"
	}
	return "read"
}

func (s *Server) fail(method string, err error) error {
	s.errs.WithLabelValues(method, rpcerr.Reason(err)).Inc()
	return rpcerr.Status(err)
}

// Write streams bytes into a RESERVED allocation. Each message is bounds
// checked whole, then its data is copied from the received buffers into the
// segment (with the data plane codec, straight from the transport's buffers).
func (s *Server) Write(stream agentv1.DataService_WriteServer) error {
	msg := newWriteMsg()
	defer msg.free()
	err := stream.RecvMsg(msg)
	if errors.Is(err, io.EOF) {
		return s.fail("write", errInvalid("empty write stream: the first message must carry a header"))
	}
	if err != nil {
		return err
	}
	hdr := msg.hdr()
	if hdr == nil {
		return s.fail("write", errInvalid("the first write message must carry a header"))
	}
	h, err := s.open(hdr.GetSegmentId(), hdr.GetAllocationId(), hdr.GetToken(), token.Write, callerTenant(stream.Context()))
	if err != nil {
		return s.fail("write", err)
	}
	defer h.Close()
	off, written := hdr.GetOffset(), uint64(0)
	for {
		n := uint64(msg.dataLen())
		if err := h.CheckBounds(off, n); err != nil {
			return s.fail("write", err)
		}
		for _, p := range msg.dataPieces() {
			if err := h.WriteAt(p, off); err != nil {
				return s.fail("write", err)
			}
			off += uint64(len(p))
		}
		written += n
		s.bytesIn.Add(float64(n))
		msg.free()
		err = stream.RecvMsg(msg)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
	}
	// Close before answering: a Seal that follows the client's return must
	// not find this write still open.
	h.Close()
	return stream.SendAndClose(&agentv1.WriteResponse{BytesWritten: written})
}

// Read streams a SEALED allocation (or a range of it) in chunks. Chunks of a
// memory segment alias the mapping; the allocation stays pinned until the
// transport has sent them.
func (s *Server) Read(req *agentv1.ReadRequest, stream agentv1.DataService_ReadServer) error {
	h, err := s.open(req.GetSegmentId(), req.GetAllocationId(), req.GetToken(), token.Read, callerTenant(stream.Context()))
	if err != nil {
		return s.fail("read", err)
	}
	p := newPin(h.Close)
	defer p.done()
	size, off, length := h.Size(), req.GetOffset(), req.GetLength()
	if off > size {
		return s.fail("read", rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OUT_OF_BOUNDS, "offset %d is past the end of the %d-byte object", off, size))
	}
	if length == 0 {
		length = size - off
	}
	if length > size-off {
		return s.fail("read", rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_OUT_OF_BOUNDS, "bytes [%d, %d) lie outside the %d-byte object", off, off+length, size))
	}
	chunk := uint64(s.cfg.ChunkSize)
	if c := req.GetChunkSize(); c != 0 {
		chunk = uint64(min(int(c), MaxChunkSize))
	}
	var buf []byte // disk segments: one buffer for the whole stream
	for sent, first := uint64(0), true; first || sent < length; first = false {
		if err := stream.Context().Err(); err != nil {
			return status.FromContextError(err).Err()
		}
		n := min(chunk, length-sent)
		data, err := h.Bytes(off+sent, n)
		if err != nil {
			return s.fail("read", err)
		}
		rc := &readChunk{ReadResponse: &agentv1.ReadResponse{}}
		if data != nil {
			rc.pin = p
		} else if n > 0 {
			// Disk: the standard marshalling copies, so buf is reusable.
			if uint64(cap(buf)) < n {
				buf = make([]byte, n)
			}
			data = buf[:n]
			if err := h.ReadAt(data, off+sent); err != nil {
				return s.fail("read", err)
			}
		}
		rc.Data = data
		if first {
			rc.ObjectSize, rc.Checksum = size, h.Checksum()
		}
		if err := stream.SendMsg(rc); err != nil {
			return err
		}
		s.bytesOut.Add(float64(n))
		sent += n
	}
	return nil
}

func itemResult(err error) *agentv1.ItemResult {
	st := rpcerr.Item(err)
	return &agentv1.ItemResult{Code: st.GetCode(), Reason: st.GetReason(), Message: st.GetMessage()}
}

// BatchWrite writes many small objects, each whole into its allocation.
func (s *Server) BatchWrite(ctx context.Context, req *agentv1.BatchWriteRequest) (*agentv1.BatchWriteResponse, error) {
	out := &agentv1.BatchWriteResponse{Results: make([]*agentv1.ItemResult, len(req.GetItems()))}
	tenant := callerTenant(ctx)
	for i, it := range req.GetItems() {
		err := ctx.Err()
		if err == nil {
			err = s.writeItem(it, tenant)
		}
		if err != nil {
			s.errs.WithLabelValues("batch_write", rpcerr.Reason(err)).Inc()
		}
		out.Results[i] = itemResult(err)
	}
	return out, nil
}

func (s *Server) writeItem(it *agentv1.BatchWriteItem, callerTenant string) error {
	h, err := s.open(it.GetSegmentId(), it.GetAllocationId(), it.GetToken(), token.Write, callerTenant)
	if err != nil {
		return err
	}
	defer h.Close()
	if err := h.WriteAt(it.GetData(), 0); err != nil {
		return err
	}
	s.bytesIn.Add(float64(len(it.GetData())))
	return nil
}

// BatchRead reads many small SEALED objects whole.
func (s *Server) BatchRead(ctx context.Context, req *agentv1.BatchReadRequest) (*agentv1.BatchReadResponse, error) {
	out := &agentv1.BatchReadResponse{Results: make([]*agentv1.BatchReadResult, len(req.GetItems()))}
	var total uint64
	tenant := callerTenant(ctx)
	for i, it := range req.GetItems() {
		err := ctx.Err()
		var r *agentv1.BatchReadResult
		if err == nil {
			r, err = s.readItem(it, &total, tenant)
		}
		if err != nil {
			s.errs.WithLabelValues("batch_read", rpcerr.Reason(err)).Inc()
			r = &agentv1.BatchReadResult{}
		}
		r.Status = itemResult(err)
		out.Results[i] = r
	}
	return out, nil
}

func (s *Server) readItem(it *agentv1.BatchReadItem, total *uint64, callerTenant string) (*agentv1.BatchReadResult, error) {
	h, err := s.open(it.GetSegmentId(), it.GetAllocationId(), it.GetToken(), token.Read, callerTenant)
	if err != nil {
		return nil, err
	}
	defer h.Close()
	if *total+h.Size() > MaxBatchReadBytes {
		return nil, errInvalid("batch response would exceed %d bytes; read allocation %d with Read", MaxBatchReadBytes, it.GetAllocationId())
	}
	// The response is encoded after the handler returns, when the handle is
	// closed and the extent may be reused: copy.
	data := make([]byte, h.Size())
	if err := h.ReadAt(data, 0); err != nil {
		return nil, err
	}
	*total += h.Size()
	s.bytesOut.Add(float64(len(data)))
	return &agentv1.BatchReadResult{Data: data, Checksum: h.Checksum()}, nil
}

// Verify checks SEALED allocations against their sealed checksums, as a
// VERIFY of the bulk transfer listener does (verifyItem, the same bounds):
// more than xfer.MaxVerifyItems items are refused before any is opened.
func (s *Server) Verify(ctx context.Context, req *agentv1.VerifyRequest) (*agentv1.VerifyResponse, error) {
	items := req.GetItems()
	if len(items) > xfer.MaxVerifyItems {
		return nil, s.fail("verify", errInvalid("%d items to verify, at most %d", len(items), xfer.MaxVerifyItems))
	}
	out := &agentv1.VerifyResponse{Results: make([]*agentv1.VerifyResult, len(items))}
	tenant := callerTenant(ctx)
	for i, it := range items {
		r := &agentv1.VerifyResult{}
		err := ctx.Err()
		if err == nil {
			r.ObjectSize, r.Checksum, err = s.verifyItem(it.GetSegmentId(), it.GetAllocationId(), it.GetToken(), tenant)
		}
		if err != nil {
			s.errs.WithLabelValues("verify", rpcerr.Reason(err)).Inc()
		}
		r.Status = itemResult(err)
		out.Results[i] = r
	}
	return out, nil
}
