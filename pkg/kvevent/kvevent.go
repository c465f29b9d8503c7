// Package kvevent is the Mooncake-compatible KV event wire format
// (docs/kv-events-contract.md): the encoder the gateway publishes with, a
// strict decoder that rejects every contract violation, and a subscriber
// library (Subscribe) that connects a SUB socket, detects sequence gaps,
// optionally repairs them through the replay ROUTER, and maintains the
// (tenant, key, medium) index a scheduler routes with.
//
// A message on the PUB socket has exactly three frames:
//
//	0  topic     always empty
//	1  sequence  u64 big-endian, 8 bytes, gap-free from 1
//	2  payload   msgpack [timestamp_ms, [event_map, ... ≤64], dp_rank]
//
// The opt-in snapshot stream format (docs/gateway-state.md; the dialect of
// vLLM's KV-event snapshots as llm-d consumes it) differs in two ways: the
// sequence frame is 24 bytes, the sequence followed by the 16-byte
// publisher epoch (DecodeSeqFrame, Batch.Epoch), and an idle publisher
// sends heartbeats, batches with an empty event array that take a sequence
// number (Batch.Heartbeat). The gateway's snapshot endpoint serves the
// state at a sequence number (FetchSnapshot); a Subscriber with
// Options.SnapshotEndpoint bootstraps from it and rebuilds from it whenever
// the stream's continuity is lost.
//
// The encoder writes msgpack by hand (no reflection, one pass, reusable
// buffers); the decoder is a one-pass strict reader. Tests cross-check both
// against github.com/shamaton/msgpack/v2 as an independent msgpack oracle.
//
// Public API of the Crescent module, with pkg/client (and pkg/kvevent/zmtp,
// whose errors it wraps).
package kvevent

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// MaxEventsPerBatch is the contract's bound on events in one message.
const MaxEventsPerBatch = 64

// EndSeq is the sequence number of the replay end marker (its payload is empty).
const EndSeq = ^uint64(0)

// ErrMalformed wraps every contract violation the decoder reports.
var ErrMalformed = errors.New("kvevent: malformed message")

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
}

// EventType is event_type on the wire.
type EventType uint8

// Event types.
const (
	TypeUnknown EventType = iota
	Stored
	Removed
	Cleared
)

func (t EventType) String() string {
	switch t {
	case Stored:
		return "stored"
	case Removed:
		return "removed"
	case Cleared:
		return "cleared"
	default:
		return "unknown"
	}
}

// LegacyName is the legacy "type" value (emit_legacy_compat).
func (t EventType) LegacyName() string {
	switch t {
	case Stored:
		return "BlockStored"
	case Removed:
		return "BlockRemoved"
	case Cleared:
		return "AllBlocksCleared"
	default:
		return ""
	}
}

// PerObject reports whether the event names one object (stored, removed).
func (t EventType) PerObject() bool { return t == Stored || t == Removed }

// Medium is the logical tier on the wire: "cpu" for memory replicas, "disk"
// for every other class, nil on cleared.
type Medium uint8

// Media.
const (
	MediumNone Medium = iota
	MediumCPU
	MediumDisk
)

func (m Medium) String() string {
	switch m {
	case MediumCPU:
		return "cpu"
	case MediumDisk:
		return "disk"
	default:
		return "nil"
	}
}

// Envelope is the per-publisher part of every event: configured once on the
// gateway, repeated in each event map.
type Envelope struct {
	// BackendID is required (never nil on the wire).
	BackendID string
	// ModelName, AdditionalSalt, LoraName: "" is nil on the wire.
	ModelName      string
	AdditionalSalt string
	LoraName       string
	// BlockSize 0 is nil on the wire.
	BlockSize uint32
	DPRank    uint32
}

// Event is one KV event. On encode, the encoder takes ID, Type, Tenant, Key,
// Medium and GroupID from the event and the envelope and timestamp from its
// configuration and the batch; on decode every field is filled.
type Event struct {
	// ID is event_id: monotonic per publisher process.
	ID uint64
	// Timestamp is the event's timestamp in Unix ms (equal to the batch's).
	Timestamp int64
	Type      EventType
	Tenant    string
	// Key is object_key, verbatim (stored and removed only).
	Key string
	// Medium is MediumNone on cleared.
	Medium Medium
	// GroupID "" is nil on the wire (stored and removed only).
	GroupID string
	// Envelope is the publisher identity the event carried.
	Envelope Envelope
	// Legacy reports the event carried the legacy-compat fields (decode only).
	Legacy bool
}

// Batch is one PUB message: a sequence number and up to 64 events.
type Batch struct {
	Seq       uint64
	Timestamp int64
	DPRank    uint32
	// Events holds 1 to 64 events; none in a heartbeat (see Heartbeat).
	Events []Event
	// Replayed is set by the subscriber on batches fetched from the replay socket.
	Replayed bool
	// Epoch is the publisher epoch the sequence frame carried (EpochLen
	// bytes, snapshot stream format); nil in the Mooncake format. Batches of
	// one epoch may share the slice: do not modify it.
	Epoch []byte
	// Snapshot is set on the chunks of a snapshot (FetchSnapshot, and the
	// subscriber's bootstraps and rebuilds); their Seq is the snapshot's cut.
	Snapshot bool
}

// Heartbeat reports whether b is a heartbeat of the snapshot stream format:
// a batch with no events that only takes a sequence number.
func (b Batch) Heartbeat() bool { return len(b.Events) == 0 }

// EpochLen is the length of a publisher epoch in a snapshot-format
// sequence frame and a snapshot reply.
const EpochLen = 16

// PutSeq returns the 8-byte big-endian sequence frame.
func PutSeq(seq uint64) []byte {
	b := make([]byte, 8)
	binary.BigEndian.PutUint64(b, seq)
	return b
}

// PutSeqEpoch returns the 24-byte sequence frame of the snapshot stream
// format: the 8-byte big-endian sequence followed by the publisher epoch,
// which must be EpochLen bytes (it panics otherwise).
func PutSeqEpoch(seq uint64, epoch []byte) []byte {
	if len(epoch) != EpochLen {
		panic(fmt.Sprintf("kvevent: PutSeqEpoch with a %d-byte epoch, want %d", len(epoch), EpochLen))
	}
	b := make([]byte, 8, 8+EpochLen)
	binary.BigEndian.PutUint64(b, seq)
	return append(b, epoch...)
}
