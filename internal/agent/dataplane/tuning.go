package dataplane

import "google.golang.org/grpc"

const (
	streamWindow = 16 << 20
	connWindow   = 64 << 20
	ioBuffer     = 1 << 20
)

// ServerOptions are the gRPC server options the data plane is tuned for:
// its codec and the transport tuning.
func ServerOptions() []grpc.ServerOption {
	// ForceServerCodecV2 is experimental in grpc-go; the codec falls back
	// to the standard proto codec for every message but the two bulk ones.
	return append([]grpc.ServerOption{grpc.ForceServerCodecV2(newCodec())}, transportOptions()...)
}

// transportOptions are the flow-control and buffer settings alone.
func transportOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.InitialWindowSize(streamWindow),
		grpc.InitialConnWindowSize(connWindow),
		grpc.ReadBufferSize(ioBuffer),
		grpc.WriteBufferSize(ioBuffer),
	}
}

// DialOptions are the matching client options for connections that move
// object bytes (clients of DataService, and agent-to-agent copies).
func DialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithInitialWindowSize(streamWindow),
		grpc.WithInitialConnWindowSize(connWindow),
		grpc.WithReadBufferSize(ioBuffer),
		grpc.WithWriteBufferSize(ioBuffer),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(256<<20), grpc.MaxCallSendMsgSize(256<<20)),
	}
}
