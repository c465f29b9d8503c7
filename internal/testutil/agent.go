package testutil

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"

	"github.com/cespare/xxhash/v2"
	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/xfer"
	"google.golang.org/grpc"
)

// FakeAgent is one agent of a Fake: DataService on a loopback port and,
// with FakeConfig.Transfer, a bulk transfer listener. It checks the
// allocation, its state (writable until PutEnd, readable after) and the
// token the master issued, as a real agent does.
type FakeAgent struct {
	f     *Fake
	index int
	grpc  *grpc.Server
	lis   net.Listener
	xlis  net.Listener
	wg    sync.WaitGroup

	mu      sync.Mutex // guards conns, stopped
	conns   map[net.Conn]bool
	stopped bool
}

func startAgent(f *Fake, i int) (*FakeAgent, error) {
	a := &FakeAgent{f: f, index: i, conns: map[net.Conn]bool{}}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	a.lis = lis
	if f.cfg.Transfer {
		if a.xlis, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			_ = lis.Close()
			return nil, err
		}
		a.wg.Go(a.acceptTransfers)
	}
	a.grpc = grpc.NewServer(rpccodec.ServerOption(), grpc.UnaryInterceptor(a.unary), grpc.StreamInterceptor(a.stream))
	agentv1.RegisterDataServiceServer(a.grpc, dataService{a: a})
	a.wg.Go(func() { _ = a.grpc.Serve(lis) })
	return a, nil
}

// ID is the agent's id ("agent-0").
func (a *FakeAgent) ID() string { return fmt.Sprintf("agent-%d", a.index) }

// HostID is the agent's host id ("host-0").
func (a *FakeAgent) HostID() string { return fmt.Sprintf("host-%d", a.index) }

// Addr is the DataService host:port.
func (a *FakeAgent) Addr() string { return a.lis.Addr().String() }

// TransferAddr is the bulk transfer host:port, "" without one.
func (a *FakeAgent) TransferAddr() string {
	if a.xlis == nil {
		return ""
	}
	return a.xlis.Addr().String()
}

// Stop closes the agent's listeners and connections: calls to it fail as
// calls to a dead agent do. Idempotent.
func (a *FakeAgent) Stop() {
	a.mu.Lock()
	if a.stopped {
		a.mu.Unlock()
		return
	}
	a.stopped = true
	for c := range a.conns {
		_ = c.Close()
	}
	a.mu.Unlock()
	a.grpc.Stop()
	if a.xlis != nil {
		_ = a.xlis.Close()
	}
	a.wg.Wait()
}

// before counts a call and runs the agent hook.
func (a *FakeAgent) before(method string) error {
	a.f.mu.Lock()
	a.f.calls[method]++
	hook := a.f.agentHook
	a.f.mu.Unlock()
	if hook != nil {
		return hook(a.index, method)
	}
	return nil
}

func shortName(full string) string { return full[strings.LastIndex(full, "/")+1:] }

func (a *FakeAgent) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	resp, err := h(ctx, req) // BatchWrite and BatchRead run the hook per item
	_ = info
	return resp, rpcerr.Status(err)
}

func (a *FakeAgent) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	if err := a.before(shortName(info.FullMethod)); err != nil {
		return rpcerr.Status(err)
	}
	return rpcerr.Status(h(srv, ss))
}

// allocLocked finds allocation id of segment seg on this agent and checks
// its token and state (sealed: want a readable one).
func (a *FakeAgent) allocLocked(seg string, id uint64, token []byte, sealed bool) (*alloc, error) {
	f := a.f
	if a.index >= len(f.segs) || f.segs[a.index].id != seg {
		return nil, errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "segment %q is not on %s", seg, a.ID())
	}
	for _, o := range f.objects {
		for _, r := range o.replicas {
			if r.agent != a.index || r.id != id {
				continue
			}
			switch {
			case !bytes.Equal(r.token, token):
				return nil, errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_TOKEN, "bad token for allocation %d", id)
			case r.sealed != sealed:
				return nil, errorf(masterv1.ErrorReason_ERROR_REASON_ALLOCATION_STATE, "allocation %d is not %s", id, map[bool]string{true: "sealed", false: "reserved"}[sealed])
			}
			return r, nil
		}
	}
	return nil, errorf(masterv1.ErrorReason_ERROR_REASON_ALLOCATION_NOT_FOUND, "allocation %d not found", id)
}

// write copies p into an allocation at off.
func (a *FakeAgent) write(seg string, id uint64, token []byte, off uint64, p []byte) error {
	a.f.mu.Lock()
	defer a.f.mu.Unlock()
	r, err := a.allocLocked(seg, id, token, false)
	if err != nil {
		return err
	}
	if off > uint64(len(r.data)) || uint64(len(p)) > uint64(len(r.data))-off {
		return errorf(masterv1.ErrorReason_ERROR_REASON_OUT_OF_BOUNDS, "write [%d, %d) past %d bytes", off, off+uint64(len(p)), len(r.data))
	}
	copy(r.data[off:], p)
	return nil
}

// read returns a copy of [off, off+n) of a sealed allocation (n 0: to the
// end), with the object's size and checksum.
func (a *FakeAgent) read(seg string, id uint64, token []byte, off, n uint64) (data []byte, size, sum uint64, err error) {
	a.f.mu.Lock()
	defer a.f.mu.Unlock()
	r, err := a.allocLocked(seg, id, token, true)
	if err != nil {
		return nil, 0, 0, err
	}
	size = uint64(len(r.data))
	if off > size {
		return nil, 0, 0, errorf(masterv1.ErrorReason_ERROR_REASON_OUT_OF_BOUNDS, "read at %d past %d bytes", off, size)
	}
	if n == 0 || n > size-off {
		n = size - off
	}
	return bytes.Clone(r.data[off : off+n]), size, xxhash.Sum64(r.data), nil
}

func itemResult(err error) *agentv1.ItemResult {
	st := rpcerr.Item(err)
	return &agentv1.ItemResult{Code: st.GetCode(), Reason: st.GetReason(), Message: st.GetMessage()}
}

// dataService adapts a FakeAgent to DataService.
type dataService struct {
	agentv1.UnimplementedDataServiceServer
	a *FakeAgent
}

func (s dataService) Write(stream agentv1.DataService_WriteServer) error {
	var hdr *agentv1.WriteHeader
	var n uint64
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return stream.SendAndClose(&agentv1.WriteResponse{BytesWritten: n})
		}
		if err != nil {
			return err
		}
		if hdr == nil {
			if hdr = req.GetHeader(); hdr == nil {
				return errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "the first message carries no header")
			}
		}
		if err := s.a.write(hdr.GetSegmentId(), hdr.GetAllocationId(), hdr.GetToken(), hdr.GetOffset()+n, req.GetData()); err != nil {
			return err
		}
		n += uint64(len(req.GetData()))
	}
}

func (s dataService) Read(r *agentv1.ReadRequest, stream agentv1.DataService_ReadServer) error {
	data, size, sum, err := s.a.read(r.GetSegmentId(), r.GetAllocationId(), r.GetToken(), r.GetOffset(), r.GetLength())
	if err != nil {
		return err
	}
	chunk := int(r.GetChunkSize())
	if chunk <= 0 {
		chunk = 1 << 20
	}
	for first := true; first || len(data) > 0; first = false {
		n := min(chunk, len(data))
		if err := stream.Send(&agentv1.ReadResponse{Data: data[:n], ObjectSize: size, Checksum: sum}); err != nil {
			return err
		}
		data = data[n:]
	}
	return nil
}

func (s dataService) BatchWrite(_ context.Context, r *agentv1.BatchWriteRequest) (*agentv1.BatchWriteResponse, error) {
	out := &agentv1.BatchWriteResponse{}
	hookErr := s.a.before("BatchWrite")
	for _, it := range r.GetItems() {
		err := hookErr
		if err == nil {
			err = s.a.write(it.GetSegmentId(), it.GetAllocationId(), it.GetToken(), 0, it.GetData())
		}
		out.Results = append(out.Results, itemResult(err))
	}
	return out, nil
}

func (s dataService) BatchRead(_ context.Context, r *agentv1.BatchReadRequest) (*agentv1.BatchReadResponse, error) {
	out := &agentv1.BatchReadResponse{}
	hookErr := s.a.before("BatchRead")
	for _, it := range r.GetItems() {
		err := hookErr
		var data []byte
		var sum uint64
		if err == nil {
			data, _, sum, err = s.a.read(it.GetSegmentId(), it.GetAllocationId(), it.GetToken(), 0, 0)
		}
		out.Results = append(out.Results, &agentv1.BatchReadResult{Status: itemResult(err), Data: data, Checksum: sum})
	}
	return out, nil
}

func (a *FakeAgent) acceptTransfers() {
	for {
		c, err := a.xlis.Accept()
		if err != nil {
			return
		}
		a.mu.Lock()
		if a.stopped {
			a.mu.Unlock()
			_ = c.Close()
			return
		}
		a.conns[c] = true
		a.mu.Unlock()
		a.wg.Go(func() {
			defer func() {
				a.mu.Lock()
				delete(a.conns, c)
				a.mu.Unlock()
				_ = c.Close()
			}()
			_ = a.serveTransfer(c)
		})
	}
}

// serveTransfer answers one transfer connection's requests in order.
func (a *FakeAgent) serveTransfer(c net.Conn) error {
	br := bufio.NewReader(c)
	var pre [len(xfer.Preamble)]byte
	if _, err := io.ReadFull(br, pre[:]); err != nil || string(pre[:]) != xfer.Preamble {
		return errClosed
	}
	var buf []byte
	for {
		req := &agentv1.TransferRequest{}
		var err error
		if buf, err = xfer.ReadFrame(br, buf, req); err != nil {
			return err
		}
		if err := xfer.CheckRequest(req); err != nil {
			return respond(c, &agentv1.TransferResponse{Error: xfer.ItemResult(err)})
		}
		resp := &agentv1.TransferResponse{}
		var payload [][]byte
		write := req.GetOp() == agentv1.TransferOp_TRANSFER_OP_WRITE
		method := "TransferRead"
		if write {
			method = "TransferWrite"
		}
		hookErr := a.before(method)
		for _, it := range req.GetItems() {
			res := &agentv1.TransferResult{}
			err := hookErr
			if write {
				p := make([]byte, it.GetLength())
				if _, rerr := io.ReadFull(br, p); rerr != nil {
					return rerr
				}
				if err == nil {
					err = a.write(it.GetSegmentId(), it.GetAllocationId(), it.GetToken(), it.GetOffset(), p)
				}
				if err == nil {
					res.Length = uint64(len(p))
				}
			} else if err == nil {
				var data []byte
				if data, res.ObjectSize, res.Checksum, err = a.read(it.GetSegmentId(), it.GetAllocationId(), it.GetToken(), it.GetOffset(), it.GetLength()); err == nil {
					res.Length = uint64(len(data))
					payload = append(payload, data)
				}
			}
			res.Status = xfer.ItemResult(err)
			resp.Results = append(resp.Results, res)
		}
		if err := respond(c, resp, payload...); err != nil {
			return err
		}
	}
}

func respond(c net.Conn, resp *agentv1.TransferResponse, payload ...[]byte) error {
	b, err := xfer.AppendFrame(nil, resp)
	if err != nil {
		return err
	}
	return xfer.WriteFrame(c, b, payload)
}
