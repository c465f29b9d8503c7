package link

import (
	"context"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/obs/tracing"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"google.golang.org/grpc"
)

// copy streams a local sealed allocation into a reserved allocation at
// another agent.
func (l *Link) copy(ctx context.Context, r *masterv1.CopyRequest) error {
	src, dst := r.GetSource(), r.GetTarget()
	if src == nil || dst == nil || r.GetTargetEndpoint() == "" {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "copy needs a source, a target and a target endpoint")
	}
	seg, ok := l.deps.Segments.Get(src.GetSegmentId())
	if !ok {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_SEGMENT_NOT_FOUND, "no segment %q at this agent", src.GetSegmentId())
	}
	h, err := seg.OpenRead(src.GetAllocationId())
	if err != nil {
		return err
	}
	defer h.Close()
	cc, err := l.conn(r.GetTargetEndpoint())
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := agentv1.NewDataServiceClient(cc).Write(ctx)
	if err != nil {
		return rpcerr.FromStatus(err)
	}
	size, chunk := h.Size(), uint64(l.cfg.CopyChunk)
	var buf []byte
	for off, first := uint64(0), true; first || off < size; first = false {
		n := min(chunk, size-off)
		data, err := h.Bytes(off, n)
		if err != nil {
			return err
		}
		if data == nil && n > 0 {
			if uint64(cap(buf)) < n {
				buf = make([]byte, n)
			}
			data = buf[:n]
			if err := h.ReadAt(data, off); err != nil {
				return rpcerr.Wrap(masterv1.ErrorReason_ERROR_REASON_INTERNAL, err, "read allocation %d", src.GetAllocationId())
			}
		}
		req := &agentv1.WriteRequest{Data: data}
		if first {
			req.Header = &agentv1.WriteHeader{SegmentId: dst.GetSegmentId(), AllocationId: dst.GetAllocationId(), Token: r.GetTargetToken()}
		}
		if err := stream.Send(req); err != nil {
			break // the status comes from CloseAndRecv
		}
		off += n
	}
	resp, err := stream.CloseAndRecv()
	if err != nil {
		return rpcerr.FromStatus(err)
	}
	if resp.GetBytesWritten() != size {
		return rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INTERNAL, "target wrote %d of %d bytes", resp.GetBytesWritten(), size)
	}
	l.met.copiedBytes.Add(float64(size))
	return nil
}

// conn returns a cached connection to another agent's DataService.
func (l *Link) conn(endpoint string) (*grpc.ClientConn, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_AGENT_UNAVAILABLE, "agent is shutting down")
	}
	if c, ok := l.conns[endpoint]; ok {
		return c, nil
	}
	opts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(l.creds()),
		rpccodec.DialOption(),
		tracing.DialOption(),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(256<<20), grpc.MaxCallRecvMsgSize(256<<20)),
	}, l.deps.CopyDialOptions...)
	c, err := grpc.NewClient(endpoint, opts...)
	if err != nil {
		return nil, rpcerr.Wrap(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, err, "target endpoint %q", endpoint)
	}
	l.conns[endpoint] = c
	return c, nil
}
