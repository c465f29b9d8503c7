package kvevent

import (
	"bytes"
	"encoding/binary"
	"math"
	"strings"
)

// Decoder is the strict decoder of the contract. The zero value is ready and
// strict. A Decoder keeps a small cache of recently seen strings to avoid
// re-allocating repeated envelope values, so it is not safe for concurrent
// use; use one per goroutine.
type Decoder struct {
	// AllowUnknownKeys accepts (and skips) event map keys the contract does
	// not define, for forward compatibility. Off by default: strict.
	AllowUnknownKeys bool
	// AllowEmpty makes DecodePayload (and Replay) accept an empty event
	// array, a heartbeat of the snapshot stream format, for payloads whose
	// format no sequence frame tells: journal records, and replayed
	// batches, whose sequence frame is 8 bytes in either format (vLLM's,
	// the gateway's). DecodeMessage accepts a heartbeat exactly when its
	// sequence frame carries an epoch, whatever this field says.
	AllowEmpty bool
	// Topic is the topic frame the stream carries: empty in the Mooncake
	// format (the contract requires it); in the snapshot format, the
	// gateway's --topic (llm-d's kv@<address:port>@<model>) or empty.
	// A message with another topic is malformed.
	Topic string

	// last values seen, reused when the next event repeats them.
	backend, model, salt, lora, tenant, group string
	// epoch is the last epoch seen, shared by the batches that repeat it.
	epoch []byte
}

// payloadKind selects the rules DecodePayload applies to the event array.
type payloadKind uint8

const (
	// kindLive: 1..64 events with increasing event ids (the contract).
	kindLive payloadKind = iota
	// kindHeartbeatOK: kindLive, or no events at all (snapshot format).
	kindHeartbeatOK
	// kindChunk: a snapshot chunk, 1..64 stored events with event_id 0.
	kindChunk
)

// DecodeMessage decodes one PUB message with the package's strict Decoder.
func DecodeMessage(frames [][]byte) (Batch, error) {
	var d Decoder
	return d.DecodeMessage(frames)
}

// DecodeMessage decodes the three frames of one PUB message: an empty topic,
// a sequence frame (see DecodeSeqFrame) and a payload (see DecodePayload).
//
// Mooncake format (8-byte sequence frame): the sequence is neither 0 nor
// the replay end marker and the payload holds 1 to 64 events.
//
// Snapshot format (24-byte frame: sequence and publisher epoch): the
// sequence is not the end marker (0 is allowed: vLLM's publisher counts
// from 0), the payload may hold no events (a heartbeat), and Batch.Epoch is
// set.
func (d *Decoder) DecodeMessage(frames [][]byte) (Batch, error) {
	if len(frames) != 3 {
		return Batch{}, malformed("got %d frames, want 3 (topic, seq, payload)", len(frames))
	}
	if string(frames[0]) != d.Topic {
		return Batch{}, malformed("topic frame %q, want %q", frames[0], d.Topic)
	}
	seq, epoch, err := DecodeSeqFrame(frames[1])
	if err != nil {
		return Batch{}, err
	}
	if seq == EndSeq || (seq == 0 && epoch == nil) {
		return Batch{}, malformed("sequence %#x is not a publishable sequence", seq)
	}
	kind := kindLive
	if epoch != nil {
		kind = kindHeartbeatOK
	}
	b, err := d.decodePayload(seq, frames[2], kind)
	if err != nil {
		return Batch{}, err
	}
	if epoch != nil {
		b.Epoch = d.internEpoch(epoch)
	}
	return b, nil
}

// internEpoch returns a copy of epoch that does not alias the frame,
// shared with the previous batch's when it is the same epoch.
func (d *Decoder) internEpoch(epoch []byte) []byte {
	if !bytes.Equal(d.epoch, epoch) {
		d.epoch = bytes.Clone(epoch)
	}
	return d.epoch
}

// DecodeSeq decodes a sequence frame of the Mooncake format: exactly 8
// bytes, big-endian.
func DecodeSeq(b []byte) (uint64, error) {
	if len(b) != 8 {
		return 0, malformed("sequence frame has %d bytes, want 8", len(b))
	}
	return binary.BigEndian.Uint64(b), nil
}

// DecodeSeqFrame decodes a sequence frame of either stream format: 8 bytes,
// the big-endian sequence (Mooncake; epoch is nil), or 24 bytes, the
// sequence followed by the EpochLen-byte publisher epoch (snapshot format;
// epoch aliases b). Any other length is malformed.
func DecodeSeqFrame(b []byte) (seq uint64, epoch []byte, err error) {
	switch len(b) {
	case 8:
		return binary.BigEndian.Uint64(b), nil, nil
	case 8 + EpochLen:
		return binary.BigEndian.Uint64(b), b[8 : 8+EpochLen : 8+EpochLen], nil
	}
	return 0, nil, malformed("sequence frame has %d bytes, want 8 (or 24 with an epoch)", len(b))
}

// DecodePayload decodes [timestamp_ms, [event_map, ...], dp_rank]: exactly one
// msgpack value, no trailing bytes, integer timestamp, 1..64 events, each
// with exactly the field set its type and the switches call for. With
// AllowEmpty an empty event array is accepted too (a heartbeat).
func (d *Decoder) DecodePayload(seq uint64, payload []byte) (Batch, error) {
	kind := kindLive
	if d.AllowEmpty {
		kind = kindHeartbeatOK
	}
	return d.decodePayload(seq, payload, kind)
}

func (d *Decoder) decodePayload(seq uint64, payload []byte, kind payloadKind) (Batch, error) {
	r := reader{b: payload}
	n, err := r.arrayLen()
	if err != nil {
		return Batch{}, wrapAt("payload", err)
	}
	if n != 3 {
		return Batch{}, malformed("payload array has %d elements, want 3", n)
	}
	ts, err := r.uint(math.MaxInt64)
	if err != nil {
		return Batch{}, wrapAt("timestamp_ms", err)
	}
	nev, err := r.arrayLen()
	if err != nil {
		return Batch{}, wrapAt("events", err)
	}
	switch {
	case nev == 0 && kind == kindHeartbeatOK:
	case nev == 0 || nev > MaxEventsPerBatch:
		return Batch{}, malformed("events array has %d events, want 1..%d", nev, MaxEventsPerBatch)
	}
	b := Batch{Seq: seq, Timestamp: int64(ts)}
	if nev > 0 {
		b.Events = make([]Event, nev)
	}
	for i := range b.Events {
		ev := &b.Events[i]
		if err := d.decodeEvent(&r, ev); err != nil {
			return Batch{}, wrapEvent(i, err)
		}
		if ev.Timestamp != b.Timestamp {
			return Batch{}, malformed("event %d: timestamp %d differs from the batch's %d", i, ev.Timestamp, b.Timestamp)
		}
		if kind == kindChunk {
			if ev.Type != Stored || ev.ID != 0 {
				return Batch{}, malformed("event %d: %s event with event_id %d in a snapshot chunk, want stored with event_id 0", i, ev.Type, ev.ID)
			}
			continue
		}
		if i > 0 && ev.ID <= b.Events[i-1].ID {
			return Batch{}, malformed("event %d: event_id %d not above the previous %d", i, ev.ID, b.Events[i-1].ID)
		}
	}
	dp, err := r.uint(math.MaxUint32)
	if err != nil {
		return Batch{}, wrapAt("dp_rank", err)
	}
	b.DPRank = uint32(dp)
	if r.off != len(r.b) {
		return Batch{}, malformed("%d trailing bytes after the payload", len(r.b)-r.off)
	}
	return b, nil
}

func wrapAt(field string, err error) error { return malformed("%s: %s", field, trimErr(err)) }

func wrapEvent(i int, err error) error { return malformed("event %d: %s", i, trimErr(err)) }

func trimErr(err error) string {
	return strings.TrimPrefix(err.Error(), ErrMalformed.Error()+": ")
}

// field identifies an event map key.
type field uint8

const (
	fEventID field = iota
	fTimestamp
	fEventType
	fModelName
	fBlockSize
	fAdditionalSalt
	fLoraName
	fTenantID
	fBackendID
	fMedium
	fDPRank
	fType
	fGroupID
	fObjectKey
	fSeqHashes
	fBaseBlockIdx
	fParentHash
	fTokenIDs
	fBlockHashes
	fParentBlockHash
	numFields
)

var fieldNames = [numFields]string{
	"event_id", "timestamp", "event_type", "model_name", "block_size",
	"additional_salt", "lora_name", "tenant_id", "backend_id", "medium",
	"dp_rank", "type", "group_id", "object_key", "seq_hashes",
	"base_block_idx", "parent_hash", "token_ids", "block_hashes",
	"parent_block_hash",
}

func lookupField(k []byte) (field, bool) {
	switch string(k) {
	case "event_id":
		return fEventID, true
	case "timestamp":
		return fTimestamp, true
	case "event_type":
		return fEventType, true
	case "model_name":
		return fModelName, true
	case "block_size":
		return fBlockSize, true
	case "additional_salt":
		return fAdditionalSalt, true
	case "lora_name":
		return fLoraName, true
	case "tenant_id":
		return fTenantID, true
	case "backend_id":
		return fBackendID, true
	case "medium":
		return fMedium, true
	case "dp_rank":
		return fDPRank, true
	case "type":
		return fType, true
	case "group_id":
		return fGroupID, true
	case "object_key":
		return fObjectKey, true
	case "seq_hashes":
		return fSeqHashes, true
	case "base_block_idx":
		return fBaseBlockIdx, true
	case "parent_hash":
		return fParentHash, true
	case "token_ids":
		return fTokenIDs, true
	case "block_hashes":
		return fBlockHashes, true
	case "parent_block_hash":
		return fParentBlockHash, true
	}
	return 0, false
}

type fieldSet uint32

func setOf(fs ...field) fieldSet {
	var s fieldSet
	for _, f := range fs {
		s |= 1 << f
	}
	return s
}

func (s fieldSet) names() string {
	var out []string
	for f := field(0); f < numFields; f++ {
		if s&(1<<f) != 0 {
			out = append(out, fieldNames[f])
		}
	}
	return strings.Join(out, ",")
}

var (
	envelopeSet = setOf(fEventID, fTimestamp, fEventType, fModelName, fBlockSize,
		fAdditionalSalt, fLoraName, fTenantID, fBackendID, fMedium, fDPRank)
	removedSet = envelopeSet | setOf(fGroupID, fObjectKey, fSeqHashes, fBaseBlockIdx)
	storedSet  = removedSet | setOf(fParentHash, fTokenIDs)
)

// expectedSet is the exact field set of an event of type t.
func expectedSet(t EventType, legacy bool) fieldSet {
	var s fieldSet
	switch t {
	case Stored:
		s = storedSet
		if legacy {
			s |= setOf(fType, fBlockHashes, fParentBlockHash)
		}
	case Removed:
		s = removedSet
		if legacy {
			s |= setOf(fType, fBlockHashes)
		}
	case Cleared:
		s = envelopeSet
		if legacy {
			s |= setOf(fType)
		}
	}
	return s
}

func (d *Decoder) decodeEvent(r *reader, ev *Event) error {
	n, err := r.mapLen()
	if err != nil {
		return err
	}
	var (
		seen       fieldSet
		legacyType []byte
		mediumNil  bool
	)
	for range n {
		k, err := r.str()
		if err != nil {
			return malformed("map key: %s", trimErr(err))
		}
		f, ok := lookupField(k)
		if !ok {
			if !d.AllowUnknownKeys {
				return malformed("unknown key %q", k)
			}
			if err := r.skip(0); err != nil {
				return malformed("%q: %s", k, trimErr(err))
			}
			continue
		}
		if seen&(1<<f) != 0 {
			return malformed("duplicate key %q", k)
		}
		seen |= 1 << f
		if err := d.decodeField(r, f, ev, &legacyType, &mediumNil); err != nil {
			return malformed("%s: %s", fieldNames[f], trimErr(err))
		}
	}
	if seen&(1<<fEventType) == 0 {
		return malformed("missing key event_type")
	}
	legacy := seen&(1<<fType) != 0
	want := expectedSet(ev.Type, legacy)
	if seen != want {
		if missing := want &^ seen; missing != 0 {
			return malformed("%s event: missing keys %s", ev.Type, missing.names())
		}
		return malformed("%s event: unexpected keys %s", ev.Type, (seen &^ want).names())
	}
	if legacy && string(legacyType) != ev.Type.LegacyName() {
		return malformed("type %q does not match event_type %q", legacyType, ev.Type)
	}
	switch {
	case ev.Type == Cleared && !mediumNil:
		return malformed("cleared event with medium %s, want nil", ev.Medium)
	case ev.Type != Cleared && mediumNil:
		return malformed("%s event with nil medium", ev.Type)
	}
	ev.Legacy = legacy
	return nil
}

func (d *Decoder) decodeField(r *reader, f field, ev *Event, legacyType *[]byte, mediumNil *bool) error {
	var err error
	switch f {
	case fEventID:
		ev.ID, err = r.uint(math.MaxUint64)
	case fTimestamp:
		var v uint64
		v, err = r.uint(math.MaxInt64)
		ev.Timestamp = int64(v)
	case fEventType:
		var s []byte
		if s, err = r.str(); err != nil {
			return err
		}
		switch string(s) {
		case "stored":
			ev.Type = Stored
		case "removed":
			ev.Type = Removed
		case "cleared":
			ev.Type = Cleared
		default:
			return malformed("unknown event_type %q", s)
		}
	case fModelName:
		err = r.nullableStr(&d.model, &ev.Envelope.ModelName)
	case fBlockSize:
		if r.nilNext() {
			return nil
		}
		var v uint64
		if v, err = r.uint(math.MaxUint32); err != nil {
			return err
		}
		if v == 0 {
			return malformed("0, want nil for an unset block size")
		}
		ev.Envelope.BlockSize = uint32(v)
	case fAdditionalSalt:
		err = r.nullableStr(&d.salt, &ev.Envelope.AdditionalSalt)
	case fLoraName:
		err = r.nullableStr(&d.lora, &ev.Envelope.LoraName)
	case fTenantID:
		err = r.internStr(&d.tenant, &ev.Tenant)
	case fBackendID:
		err = r.internStr(&d.backend, &ev.Envelope.BackendID)
	case fMedium:
		if r.nilNext() {
			*mediumNil = true
			return nil
		}
		var s []byte
		if s, err = r.str(); err != nil {
			return err
		}
		switch string(s) {
		case "cpu":
			ev.Medium = MediumCPU
		case "disk":
			ev.Medium = MediumDisk
		default:
			return malformed("%q, want cpu, disk or nil", s)
		}
	case fDPRank:
		var v uint64
		v, err = r.uint(math.MaxUint32)
		ev.Envelope.DPRank = uint32(v)
	case fType:
		*legacyType, err = r.str()
	case fGroupID:
		err = r.nullableStr(&d.group, &ev.GroupID)
	case fObjectKey:
		var s []byte
		if s, err = r.str(); err != nil {
			return err
		}
		ev.Key = string(s)
	case fSeqHashes, fBlockHashes:
		var n int
		if n, err = r.arrayLen(); err != nil {
			return err
		}
		if n != 0 {
			return malformed("array of %d, want [] (keys are never interpreted)", n)
		}
	case fBaseBlockIdx, fParentHash, fTokenIDs, fParentBlockHash:
		if !r.nilNext() {
			return malformed("want nil")
		}
	}
	return err
}
