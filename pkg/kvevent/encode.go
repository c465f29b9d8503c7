package kvevent

import (
	"errors"
	"fmt"
	"math"
)

// EncoderOptions configures an Encoder: the envelope every event repeats and
// the contract's two switches.
type EncoderOptions struct {
	Envelope Envelope
	// LegacyCompat adds "type", "block_hashes" (= []) and, on stored,
	// "parent_block_hash" (nil). Mooncake's default is true.
	LegacyCompat bool
	// ObjectKey false suppresses every stored/removed event (the publisher
	// counts them as skipped_keyless_events); only cleared is published.
	ObjectKey bool
}

// Encoder writes payloads of the contract. It holds only immutable
// precomputed byte strings, so one Encoder may be shared by goroutines.
type Encoder struct {
	opts EncoderOptions
	// envelope is the pre-encoded constant key/value pairs of every event:
	// model_name, block_size, additional_salt, lora_name, backend_id, dp_rank.
	envelope []byte
	// typeKV[t] is event_type (+ legacy type) for t.
	typeKV [4][]byte
	// tail[t] is the constant per-object tail for t (seq_hashes, ...).
	tail [4][]byte
	// nkeys[t] is the number of map entries of an event of type t.
	nkeys [4]int
	dp    uint32
}

// envelopeKeys is the number of envelope entries every event carries.
const envelopeKeys = 11 // event_id timestamp event_type model_name block_size additional_salt lora_name tenant_id backend_id medium dp_rank

// NewEncoder precomputes the constant parts of every event.
func NewEncoder(opts EncoderOptions) *Encoder {
	e := &Encoder{opts: opts, dp: opts.Envelope.DPRank}
	env := opts.Envelope
	b := appendStr(nil, "model_name")
	b = appendNullableStr(b, env.ModelName)
	b = appendStr(b, "block_size")
	if env.BlockSize == 0 {
		b = appendNil(b)
	} else {
		b = appendUint(b, uint64(env.BlockSize))
	}
	b = appendStr(b, "additional_salt")
	b = appendNullableStr(b, env.AdditionalSalt)
	b = appendStr(b, "lora_name")
	b = appendNullableStr(b, env.LoraName)
	b = appendStr(b, "backend_id")
	b = appendStr(b, env.BackendID)
	b = appendStr(b, "dp_rank")
	b = appendUint(b, uint64(env.DPRank))
	e.envelope = b

	for _, t := range []EventType{Stored, Removed, Cleared} {
		kv := appendStr(nil, "event_type")
		kv = appendStr(kv, t.String())
		n := envelopeKeys
		if opts.LegacyCompat {
			kv = appendStr(kv, "type")
			kv = appendStr(kv, t.LegacyName())
			n++
		}
		e.typeKV[t] = kv
		var tl []byte
		if t.PerObject() {
			n += 2 // group_id, object_key
			tl = appendStr(tl, "seq_hashes")
			tl = appendArrayHeader(tl, 0)
			tl = appendStr(tl, "base_block_idx")
			tl = appendNil(tl)
			n += 2
			if t == Stored {
				tl = appendStr(tl, "parent_hash")
				tl = appendNil(tl)
				tl = appendStr(tl, "token_ids")
				tl = appendNil(tl)
				n += 2
			}
			if opts.LegacyCompat {
				tl = appendStr(tl, "block_hashes")
				tl = appendArrayHeader(tl, 0)
				n++
				if t == Stored {
					tl = appendStr(tl, "parent_block_hash")
					tl = appendNil(tl)
					n++
				}
			}
		}
		e.tail[t] = tl
		e.nkeys[t] = n
	}
	return e
}

// Options returns the options the encoder was built with.
func (e *Encoder) Options() EncoderOptions { return e.opts }

// Emits reports whether events of type t are published under the switches
// (false for stored/removed when ObjectKey is off).
func (e *Encoder) Emits(t EventType) bool {
	return !t.PerObject() || e.opts.ObjectKey
}

// Errors AppendBatch returns for input it cannot encode within the contract.
var (
	ErrBatchSize = errors.New("kvevent: a batch holds 1 to 64 events")
	ErrEvent     = errors.New("kvevent: invalid event")
)

// AppendBatch appends the msgpack payload [ts, [events], dp_rank] to dst.
// Each event's ID, Type, Tenant, Key, Medium and GroupID are encoded; its
// timestamp is ts and its envelope is the encoder's. Suppressed events must
// have been filtered out by the caller (see Emits).
func (e *Encoder) AppendBatch(dst []byte, ts int64, evs []Event) ([]byte, error) {
	if len(evs) == 0 || len(evs) > MaxEventsPerBatch {
		return dst, fmt.Errorf("%w: got %d", ErrBatchSize, len(evs))
	}
	if ts < 0 {
		return dst, fmt.Errorf("%w: negative timestamp %d", ErrEvent, ts)
	}
	dst = append(dst, 0x93)
	dst = appendUint(dst, uint64(ts))
	dst = appendArrayHeader(dst, len(evs))
	// "timestamp": ts is the same in every event of the batch.
	var tsKV [32]byte
	tskv := appendUint(appendStr(tsKV[:0], "timestamp"), uint64(ts))
	for i := range evs {
		ev := &evs[i]
		t := ev.Type
		if t != Stored && t != Removed && t != Cleared {
			return dst, fmt.Errorf("%w: event type %d", ErrEvent, t)
		}
		if t.PerObject() && ev.Medium != MediumCPU && ev.Medium != MediumDisk {
			return dst, fmt.Errorf("%w: %s event without medium", ErrEvent, t)
		}
		dst = appendMapHeader(dst, e.nkeys[t])
		dst = append(dst, keyEventID...)
		dst = appendUint(dst, ev.ID)
		dst = append(dst, tskv...)
		dst = append(dst, e.typeKV[t]...)
		dst = append(dst, keyTenantID...)
		dst = appendStr(dst, ev.Tenant)
		dst = append(dst, keyMedium...)
		switch {
		case t == Cleared:
			dst = appendNil(dst)
		case ev.Medium == MediumCPU:
			dst = append(dst, valCPU...)
		default:
			dst = append(dst, valDisk...)
		}
		dst = append(dst, e.envelope...)
		if t.PerObject() {
			dst = append(dst, keyGroupID...)
			dst = appendNullableStr(dst, ev.GroupID)
			dst = append(dst, keyObjectKey...)
			dst = appendStr(dst, ev.Key)
			dst = append(dst, e.tail[t]...)
		}
	}
	return appendUint(dst, uint64(e.dp)), nil
}

// AppendHeartbeat appends the payload of a heartbeat of the snapshot stream
// format, [ts, [], dp_rank], to dst. It is published with a 24-byte
// sequence frame (PutSeqEpoch) and takes a sequence number like any batch.
func (e *Encoder) AppendHeartbeat(dst []byte, ts int64) ([]byte, error) {
	if ts < 0 {
		return dst, fmt.Errorf("%w: negative timestamp %d", ErrEvent, ts)
	}
	dst = append(dst, 0x93)
	dst = appendUint(dst, uint64(ts))
	dst = appendArrayHeader(dst, 0)
	return appendUint(dst, uint64(e.dp)), nil
}

var (
	keyEventID   = appendStr(nil, "event_id")
	keyTenantID  = appendStr(nil, "tenant_id")
	keyMedium    = appendStr(nil, "medium")
	keyGroupID   = appendStr(nil, "group_id")
	keyObjectKey = appendStr(nil, "object_key")
	valCPU       = appendStr(nil, "cpu")
	valDisk      = appendStr(nil, "disk")
)

// msgpack primitives (https://github.com/msgpack/msgpack/blob/master/spec.md),
// always in the shortest form, as the reference encoders write them.

func appendNil(b []byte) []byte { return append(b, 0xc0) }

func appendNullableStr(b []byte, s string) []byte {
	if s == "" {
		return appendNil(b)
	}
	return appendStr(b, s)
}

func appendStr(b []byte, s string) []byte {
	n := len(s)
	switch {
	case n <= 31:
		b = append(b, 0xa0|byte(n))
	case n <= math.MaxUint8:
		b = append(b, 0xd9, byte(n))
	case n <= math.MaxUint16:
		b = append(b, 0xda, byte(n>>8), byte(n))
	default:
		b = append(b, 0xdb, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
	return append(b, s...)
}

func appendUint(b []byte, v uint64) []byte {
	switch {
	case v <= 0x7f:
		return append(b, byte(v))
	case v <= math.MaxUint8:
		return append(b, 0xcc, byte(v))
	case v <= math.MaxUint16:
		return append(b, 0xcd, byte(v>>8), byte(v))
	case v <= math.MaxUint32:
		return append(b, 0xce, byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	default:
		return append(b, 0xcf, byte(v>>56), byte(v>>48), byte(v>>40), byte(v>>32),
			byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	}
}

func appendArrayHeader(b []byte, n int) []byte {
	switch {
	case n <= 15:
		return append(b, 0x90|byte(n))
	case n <= math.MaxUint16:
		return append(b, 0xdc, byte(n>>8), byte(n))
	default:
		return append(b, 0xdd, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
}

func appendMapHeader(b []byte, n int) []byte {
	switch {
	case n <= 15:
		return append(b, 0x80|byte(n))
	case n <= math.MaxUint16:
		return append(b, 0xde, byte(n>>8), byte(n))
	default:
		return append(b, 0xdf, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
}
