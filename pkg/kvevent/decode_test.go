package kvevent

import (
	"encoding/binary"
	"errors"
	"math"
	"slices"
	"testing"
)

// A small msgpack builder for hand-made (and deliberately broken) payloads.

type kv struct {
	k []byte // encoded key
	v []byte // encoded value
}

func mpStr(s string) []byte { return appendStr(nil, s) }
func mpNil() []byte         { return []byte{0xc0} }
func mpUint(v uint64) []byte {
	return appendUint(nil, v)
}
func mpInt64(v int64) []byte {
	b := []byte{0xd3, 0, 0, 0, 0, 0, 0, 0, 0}
	binary.BigEndian.PutUint64(b[1:], uint64(v))
	return b
}
func mpFloat64(f float64) []byte {
	b := []byte{0xcb, 0, 0, 0, 0, 0, 0, 0, 0}
	binary.BigEndian.PutUint64(b[1:], math.Float64bits(f))
	return b
}
func mpFloat32(f float32) []byte {
	b := []byte{0xca, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(b[1:], math.Float32bits(f))
	return b
}
func mpBin(s string) []byte { return append([]byte{0xc4, byte(len(s))}, s...) }
func mpArr(elts ...[]byte) []byte {
	b := appendArrayHeader(nil, len(elts))
	for _, e := range elts {
		b = append(b, e...)
	}
	return b
}
func mpMap(kvs []kv) []byte {
	b := appendMapHeader(nil, len(kvs))
	for _, p := range kvs {
		b = append(b, p.k...)
		b = append(b, p.v...)
	}
	return b
}

const testTS = 1_700_000_000_000

func validKVs(t EventType, legacy bool, id uint64) []kv {
	s := func(k string, v []byte) kv { return kv{mpStr(k), v} }
	kvs := []kv{
		s("event_id", mpUint(id)),
		s("timestamp", mpUint(testTS)),
		s("event_type", mpStr(t.String())),
		s("model_name", mpNil()),
		s("block_size", mpNil()),
		s("additional_salt", mpNil()),
		s("lora_name", mpNil()),
		s("tenant_id", mpStr("t")),
		s("backend_id", mpStr("b")),
		s("dp_rank", mpUint(0)),
	}
	if t == Cleared {
		kvs = append(kvs, s("medium", mpNil()))
	} else {
		kvs = append(kvs, s("medium", mpStr("cpu")),
			s("group_id", mpNil()), s("object_key", mpStr("k")),
			s("seq_hashes", mpArr()), s("base_block_idx", mpNil()))
	}
	if t == Stored {
		kvs = append(kvs, s("parent_hash", mpNil()), s("token_ids", mpNil()))
	}
	if legacy {
		kvs = append(kvs, s("type", mpStr(t.LegacyName())))
		if t.PerObject() {
			kvs = append(kvs, s("block_hashes", mpArr()))
		}
		if t == Stored {
			kvs = append(kvs, s("parent_block_hash", mpNil()))
		}
	}
	return kvs
}

func setKV(kvs []kv, k string, v []byte) []kv {
	out := slices.Clone(kvs)
	for i, p := range out {
		if string(p.k) == string(mpStr(k)) {
			out[i].v = v
			return out
		}
	}
	return append(out, kv{mpStr(k), v})
}

func delKV(kvs []kv, k string) []kv {
	return slices.DeleteFunc(slices.Clone(kvs), func(p kv) bool { return string(p.k) == string(mpStr(k)) })
}

func payload(events ...[]byte) []byte {
	return slices.Concat([]byte{0x93}, mpUint(testTS), mpArr(events...), mpUint(0))
}

func msg(p []byte) [][]byte { return [][]byte{{}, PutSeq(1), p} }

func TestDecodeAcceptsValid(t *testing.T) {
	tests := []struct {
		name   string
		frames [][]byte
		dec    Decoder
	}{
		{"stored legacy", msg(payload(mpMap(validKVs(Stored, true, 1)))), Decoder{}},
		{"stored", msg(payload(mpMap(validKVs(Stored, false, 1)))), Decoder{}},
		{"removed legacy", msg(payload(mpMap(validKVs(Removed, true, 1)))), Decoder{}},
		{"removed", msg(payload(mpMap(validKVs(Removed, false, 1)))), Decoder{}},
		{"cleared legacy", msg(payload(mpMap(validKVs(Cleared, true, 1)))), Decoder{}},
		{"cleared", msg(payload(mpMap(validKVs(Cleared, false, 1)))), Decoder{}},
		{"signed int64 event_id", msg(payload(mpMap(setKV(validKVs(Stored, true, 1), "event_id", mpInt64(99))))), Decoder{}},
		{"disk medium", msg(payload(mpMap(setKV(validKVs(Removed, true, 1), "medium", mpStr("disk"))))), Decoder{}},
		{"strings for nullables", msg(payload(mpMap(setKV(setKV(validKVs(Stored, true, 1), "model_name", mpStr("m")), "group_id", mpStr("g"))))), Decoder{}},
		{"key order free", msg(payload(mpMap(func() []kv { k := validKVs(Stored, true, 1); slices.Reverse(k); return k }()))), Decoder{}},
		{"64 events", msg(payload(func() [][]byte {
			var evs [][]byte
			for i := range 64 {
				evs = append(evs, mpMap(validKVs(Cleared, true, uint64(i+1))))
			}
			return evs
		}()...)), Decoder{}},
		{"unknown key allowed", msg(payload(mpMap(setKV(validKVs(Stored, true, 1), "future", mpArr(mpStr("x"), mpFloat64(1)))))), Decoder{AllowUnknownKeys: true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := tt.dec.DecodeMessage(tt.frames); err != nil {
				t.Errorf("DecodeMessage = %v, want nil", err)
			}
		})
	}
}

func TestDecodeRejects(t *testing.T) {
	good := mpMap(validKVs(Stored, true, 1))
	st := validKVs(Stored, true, 1)
	rm := validKVs(Removed, true, 1)
	cl := validKVs(Cleared, true, 1)
	ev := func(kvs []kv) [][]byte { return msg(payload(mpMap(kvs))) }
	seq := func(n int) []byte { return make([]byte, n) }
	tests := []struct {
		name   string
		frames [][]byte
	}{
		// frames
		{"2 frames", [][]byte{PutSeq(1), payload(good)}},
		{"4 frames", [][]byte{{}, PutSeq(1), payload(good), {}}},
		{"topic not empty", [][]byte{[]byte("kv"), PutSeq(1), payload(good)}},
		{"seq 7 bytes", [][]byte{{}, seq(7), payload(good)}},
		{"seq 9 bytes", [][]byte{{}, seq(9), payload(good)}},
		{"seq 0", [][]byte{{}, PutSeq(0), payload(good)}},
		{"seq end marker", [][]byte{{}, PutSeq(EndSeq), payload(good)}},
		// payload
		{"empty payload", msg(nil)},
		{"payload map", msg(mpMap(nil))},
		{"payload 2 elements", msg(mpArr(mpUint(1), mpArr(good)))},
		{"payload 4 elements", msg(mpArr(mpUint(1), mpArr(good), mpUint(0), mpUint(0)))},
		{"timestamp float64", msg(mpArr(mpFloat64(testTS), mpArr(good), mpUint(0)))},
		{"timestamp float32", msg(mpArr(mpFloat32(1), mpArr(good), mpUint(0)))},
		{"timestamp negative", msg(mpArr(mpInt64(-1), mpArr(good), mpUint(0)))},
		{"timestamp string", msg(mpArr(mpStr("1"), mpArr(good), mpUint(0)))},
		{"events not array", msg(mpArr(mpUint(testTS), good, mpUint(0)))},
		{"0 events", msg(mpArr(mpUint(testTS), mpArr(), mpUint(0)))},
		{"65 events", msg(payload(func() [][]byte {
			var evs [][]byte
			for i := range 65 {
				evs = append(evs, mpMap(validKVs(Cleared, true, uint64(i+1))))
			}
			return evs
		}()...))},
		{"dp_rank float", msg(mpArr(mpUint(testTS), mpArr(good), mpFloat64(0)))},
		{"dp_rank negative", msg(mpArr(mpUint(testTS), mpArr(good), []byte{0xff}))},
		{"dp_rank over u32", msg(mpArr(mpUint(testTS), mpArr(good), mpUint(1<<32)))},
		{"dp_rank nil", msg(mpArr(mpUint(testTS), mpArr(good), mpNil()))},
		{"trailing byte", msg(append(payload(good), 0xc0))},
		{"truncated", msg(payload(good)[:40])},
		{"array length lies", msg([]byte{0xdd, 0xff, 0xff, 0xff, 0xff})},
		// event envelope
		{"event not a map", msg(payload(mpArr()))},
		{"duplicate key", ev(append(slices.Clone(st), kv{mpStr("tenant_id"), mpStr("t")}))},
		{"non-string key", ev(append(slices.Clone(st), kv{mpUint(1), mpNil()}))},
		{"binary key", ev(append(slices.Clone(st), kv{mpBin("x"), mpNil()}))},
		{"unknown key", ev(setKV(st, "extra", mpNil()))},
		{"unknown event_type", ev(setKV(st, "event_type", mpStr("evicted")))},
		{"event_type int", ev(setKV(st, "event_type", mpUint(1)))},
		{"event_id float", ev(setKV(st, "event_id", mpFloat64(1)))},
		{"event_id negative", ev(setKV(st, "event_id", mpInt64(-5)))},
		{"event_id string", ev(setKV(st, "event_id", mpStr("1")))},
		{"event timestamp float", ev(setKV(st, "timestamp", mpFloat64(testTS)))},
		{"event timestamp differs", ev(setKV(st, "timestamp", mpUint(testTS+1)))},
		{"model_name int", ev(setKV(st, "model_name", mpUint(1)))},
		{"model_name binary", ev(setKV(st, "model_name", mpBin("m")))},
		{"block_size 0", ev(setKV(st, "block_size", mpUint(0)))},
		{"block_size float", ev(setKV(st, "block_size", mpFloat64(16)))},
		{"block_size over u32", ev(setKV(st, "block_size", mpUint(1<<32)))},
		{"additional_salt int", ev(setKV(st, "additional_salt", mpUint(1)))},
		{"lora_name bool", ev(setKV(st, "lora_name", []byte{0xc3}))},
		{"tenant_id nil", ev(setKV(st, "tenant_id", mpNil()))},
		{"backend_id nil", ev(setKV(st, "backend_id", mpNil()))},
		{"dp_rank nil", ev(setKV(st, "dp_rank", mpNil()))},
		{"dp_rank negative", ev(setKV(st, "dp_rank", mpInt64(-1)))},
		{"medium gpu", ev(setKV(st, "medium", mpStr("gpu")))},
		{"medium memory", ev(setKV(st, "medium", mpStr("MEMORY")))},
		{"stored medium nil", ev(setKV(st, "medium", mpNil()))},
		{"removed medium nil", ev(setKV(rm, "medium", mpNil()))},
		{"cleared medium cpu", ev(setKV(cl, "medium", mpStr("cpu")))},
		{"event_ids not increasing", msg(payload(mpMap(validKVs(Cleared, true, 2)), mpMap(validKVs(Cleared, true, 2))))},
		// per-object fields
		{"stored missing object_key", ev(delKV(st, "object_key"))},
		{"stored missing group_id", ev(delKV(st, "group_id"))},
		{"stored missing parent_hash", ev(delKV(st, "parent_hash"))},
		{"stored missing token_ids", ev(delKV(st, "token_ids"))},
		{"stored missing seq_hashes", ev(delKV(st, "seq_hashes"))},
		{"stored missing base_block_idx", ev(delKV(st, "base_block_idx"))},
		{"object_key nil", ev(setKV(st, "object_key", mpNil()))},
		{"object_key binary", ev(setKV(st, "object_key", mpBin("k")))},
		{"group_id int", ev(setKV(st, "group_id", mpUint(3)))},
		{"seq_hashes non-empty", ev(setKV(st, "seq_hashes", mpArr(mpUint(1))))},
		{"seq_hashes nil", ev(setKV(st, "seq_hashes", mpNil()))},
		{"block_hashes non-empty", ev(setKV(st, "block_hashes", mpArr(mpUint(1))))},
		{"base_block_idx 0", ev(setKV(st, "base_block_idx", mpUint(0)))},
		{"parent_hash set", ev(setKV(st, "parent_hash", mpUint(7)))},
		{"token_ids list", ev(setKV(st, "token_ids", mpArr()))},
		{"parent_block_hash set", ev(setKV(st, "parent_block_hash", mpStr("x")))},
		{"removed with parent_hash", ev(setKV(rm, "parent_hash", mpNil()))},
		{"removed with token_ids", ev(setKV(rm, "token_ids", mpNil()))},
		{"removed with parent_block_hash", ev(setKV(rm, "parent_block_hash", mpNil()))},
		{"cleared with object_key", ev(setKV(cl, "object_key", mpStr("k")))},
		{"cleared with group_id nil", ev(setKV(cl, "group_id", mpNil()))},
		{"cleared with seq_hashes", ev(setKV(cl, "seq_hashes", mpArr()))},
		{"cleared with block_hashes", ev(setKV(cl, "block_hashes", mpArr()))},
		{"cleared with base_block_idx", ev(setKV(cl, "base_block_idx", mpNil()))},
		// legacy switch: all or nothing, and consistent
		{"type without block_hashes", ev(delKV(st, "block_hashes"))},
		{"type without parent_block_hash", ev(delKV(st, "parent_block_hash"))},
		{"block_hashes without type", ev(delKV(st, "type"))},
		{"type mismatch", ev(setKV(st, "type", mpStr("BlockRemoved")))},
		{"type unknown", ev(setKV(cl, "type", mpStr("Cleared")))},
		{"type int", ev(setKV(cl, "type", mpUint(1)))},
	}
	for _, f := range contractEnvelope {
		for _, typ := range []EventType{Stored, Removed, Cleared} {
			tests = append(tests, struct {
				name   string
				frames [][]byte
			}{"missing " + f + " on " + typ.String(), ev(delKV(validKVs(typ, true, 1), f))})
		}
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var d Decoder
			b, err := d.DecodeMessage(tt.frames)
			if err == nil {
				t.Fatalf("DecodeMessage = %+v, nil error; want a rejection", b)
			}
			if !errors.Is(err, ErrMalformed) {
				t.Errorf("error %v does not wrap ErrMalformed", err)
			}
		})
	}
}
