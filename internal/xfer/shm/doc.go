// Package shm is the same-host shared-memory data path (issue 18): when a
// client runs on the agent's host, the agent hands it its memory segments
// (memfds, passed with SCM_RIGHTS over a Unix socket, as Mooncake's
// transfer engine does for local peers) and object bytes move by memcpy
// between the client's buffers and its own mapping of the segment. The
// control path stays on the socket: every read and write is still asked
// for, with the same tokens, and the agent checks token, lease, allocation
// state and bounds exactly as on the bulk TCP path (internal/xfer) before
// it answers where the bytes lie. This package holds the wire codec shared
// by the agent's server (internal/agent/dataplane, ServeShm) and the
// client (Client) that pkg/client uses.
//
// # Wire format
//
// The frames are the bulk transfer protocol's (u32le(len(header)) and a
// protobuf header, internal/xfer), with the same limits. A connection:
//
//	client: "CSM1"                      the preamble
//	agent:  hello                       with SCM_RIGHTS: one memfd per segment
//	client: request                     TransferRequest, op READ or WRITE
//	agent:  grant                       TransferResponse + u64le offset per item
//	client: release                     u32le(0), an empty header
//	agent:  (WRITE only) u32le(0)       an empty TransferResponse: done
//	...     the next request
//
// The hello is a TransferResponse shaped like a READ answer: one result per
// shared memory segment, whose length is the length of the segment's id and
// object_size the size of its mapping, and the ids concatenated as the
// payload. The first sendmsg of the hello carries the memfds, one per
// result, in order. A refused connection (peer check, limits) gets a
// TransferResponse whose error is set instead, and is closed. At most
// MaxSegments segments, ids of 1 to MaxSegmentIDBytes bytes.
//
// A request is a TransferRequest of the bulk protocol (1 to xfer.MaxItems
// items, no payload: a WRITE item's length is the number of bytes the client
// will write). The grant is the TransferResponse the bulk protocol would
// answer (status, length, object_size and checksum per item) followed by
// 8 bytes per item: where the item's bytes start in its segment's mapping
// (0 for a failed item). Items of a segment the hello did not share fail
// with SEGMENT_NOT_FOUND. Between the grant and the release the agent
// holds every granted allocation open, exactly as it does while it sends
// or receives those bytes on the bulk path: a read's extent cannot be freed
// and reused under the client's copy, and a write's allocation cannot be
// sealed before the client's copy ends. The agent waits for the release at
// most its I/O timeout, then closes the connection (and the allocations).
// A WRITE's release is answered once the allocations are closed, so a
// PutEnd (Seal) that follows never finds the write open; the Seal hashes the
// bytes in the mapping against the client's checksum, as it does after a
// TCP write. A READ's release is not answered: the client verifies the
// bytes it copied against the object's checksum.
//
// # Trust
//
// A memfd gives its holder every byte of the segment, all tenants', for as
// long as it keeps the mapping, and write access to them. Tokens bound what
// the control protocol grants; they do not bound what a peer that ignores
// the protocol can touch in its mapping. So the agent checks the peer's
// credentials (SO_PEERCRED) before it sends anything: the same uid as the
// agent, or one of an allowed list. The path is for a trusted inference
// engine on the agent's host, not for tenants that must be kept apart.
//
// Internal to the Crescent module.
package shm
