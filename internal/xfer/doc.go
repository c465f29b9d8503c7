// Package xfer is the bulk transfer protocol: the agent's fast path for
// object bytes, on its own TCP listener (crescent-agent --transfer-addr),
// beside the gRPC DataService. This package holds the wire codec shared by
// the agent's server (services/agent/internal/dataplane) and the client Pool
// that pkg/client uses.
//
// # Why a second protocol
//
// gRPC's HTTP/2 framing, flow control and per-message copies cost more than
// half of loopback TCP throughput for 1 MiB objects (services/agent/
// BENCHMARKS.md). Here a request is a small protobuf header followed by the
// raw payload: the client sends its buffers with one writev (net.Buffers,
// never copied), the agent receives a memory segment's bytes straight into
// the segment's mapping and sends them straight from it, and the client
// reads them straight into the caller's buffers. It is the same idea as
// Mooncake's Transfer Engine moving bytes beside its RPC.
//
// # Wire format
//
// proto/crescent/agent/v1/transfer.proto is the normative specification. A
// connection starts with the client's 4-byte Preamble "CXF1". Then the
// client sends requests and the agent answers each in order, one at a time:
//
//	request  = u32le(len(header)) TransferRequest [payload]
//	response = u32le(len(header)) TransferResponse [payload]
//
// A WRITE request's payload is the items' bytes concatenated, item i being
// exactly items[i].length bytes; the response has no payload. A READ
// response's payload is the bytes of the items whose result is OK,
// concatenated in order, item i being exactly results[i].length bytes.
//
// Limits both sides enforce: a header is at most MaxHeaderBytes (a
// zero-length header is a valid, empty protobuf message, so the frame layer
// accepts it; the empty TransferRequest it decodes to has no operation and
// the agent refuses it), a request names 1 to MaxItems items (a response
// carries as many results), and the items' lengths add up to less than
// 2^63. Both are checked before anything is allocated for them: the length
// prefix before the header is read, the item count by a scan of the raw
// header before it is decoded. An agent may accept less than
// MaxHeaderBytes (crescent-agent --transfer-max-header-bytes) and refuse
// more with RESOURCE_EXHAUSTED LIMIT_EXCEEDED. A failed WRITE
// item's payload is read and dropped so the next item stays framed, up to
// MaxDrainBytes per failed item; beyond that the agent refuses the request.
// A refused request (malformed header, limits) gets a TransferResponse whose
// error is set, and the agent closes the connection. So does a connection
// the agent refuses at once because it holds too many (RESOURCE_EXHAUSTED
// LIMIT_EXCEEDED, in answer to whatever request the client sends first).
//
// # TLS
//
// With mutual TLS on (issue 14) the listener is a TLS listener and the
// protocol above runs inside the TLS session unchanged: the client (Pool
// with Config.TLS) completes the handshake within its dial timeout before
// it sends the preamble, the agent completes it within its I/O timeout
// before it reads one, and the agent knows the caller by the SPIFFE id of
// its verified certificate. There is no bearer token here: a caller without
// a certificate uses DataService. Nothing else changes, except that the
// payload moves through crypto/tls's buffers instead of writev and readv
// straight from and into the caller's memory (BENCHMARKS.md, "mTLS cost").
//
// # Errors
//
// Per-item failures are the same *rpcerr.Error values DataService produces
// (code and reason, so errors.Is against reason sentinels and
// rpcerr.Reason work). A failed connection is an UNAVAILABLE
// AGENT_UNAVAILABLE error that also wraps the network error; a peer that
// breaks the protocol is an INTERNAL error that wraps ErrProtocol; a caller's
// invalid arguments are INVALID_ARGUMENT INVALID_PARAMS. A cancelled or
// expired context makes a call return ctx.Err() itself.
//
// Internal to the Crescent module: the services, the CLI and pkg/client
// import it; other modules cannot, so it may change in any release.
package xfer
