package kvevent

import (
	"fmt"
	"testing"

	"github.com/shamaton/msgpack/v2"
)

func benchEvents() []Event {
	evs := make([]Event, MaxEventsPerBatch)
	for i := range evs {
		evs[i] = Event{ID: uint64(1000 + i), Type: Stored, Tenant: "tenant-a",
			Key: fmt.Sprintf("model/llama/layer-%02d/block-%08d", i%32, i), Medium: MediumCPU, GroupID: "g"}
	}
	return evs
}

// BenchmarkEncode measures the hand-written encoder on full 64-event batches.
func BenchmarkEncode(b *testing.B) {
	enc := NewEncoder(EncoderOptions{Envelope: goldenEnvelope(), LegacyCompat: true, ObjectKey: true})
	evs := benchEvents()
	var buf []byte
	b.ReportAllocs()
	for b.Loop() {
		var err error
		buf, err = enc.AppendBatch(buf[:0], 1_700_000_000_000, evs)
		if err != nil {
			b.Fatal(err)
		}
	}
	b.SetBytes(int64(len(buf)))
	b.ReportMetric(float64(b.N*len(evs))/b.Elapsed().Seconds(), "events/s")
}

// BenchmarkEncodeReflect is the same batch through shamaton/msgpack's
// reflection encoder (maps of any), for comparison.
func BenchmarkEncodeReflect(b *testing.B) {
	evs := benchEvents()
	b.ReportAllocs()
	for b.Loop() {
		maps := make([]any, len(evs))
		for i, ev := range evs {
			maps[i] = map[string]any{
				"event_id": ev.ID, "timestamp": int64(1_700_000_000_000), "event_type": "stored",
				"model_name": "llama-3-8b", "block_size": uint32(16), "additional_salt": nil,
				"lora_name": nil, "tenant_id": ev.Tenant, "backend_id": "gw-1", "medium": "cpu",
				"dp_rank": uint32(2), "type": "BlockStored", "group_id": ev.GroupID,
				"object_key": ev.Key, "seq_hashes": []any{}, "base_block_idx": nil,
				"parent_hash": nil, "token_ids": nil, "block_hashes": []any{}, "parent_block_hash": nil,
			}
		}
		if _, err := msgpack.Marshal([]any{int64(1_700_000_000_000), maps, uint32(2)}); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*len(evs))/b.Elapsed().Seconds(), "events/s")
}

// BenchmarkDecode measures the strict decoder on full batches.
func BenchmarkDecode(b *testing.B) {
	enc := NewEncoder(EncoderOptions{Envelope: goldenEnvelope(), LegacyCompat: true, ObjectKey: true})
	p, err := enc.AppendBatch(nil, 1_700_000_000_000, benchEvents())
	if err != nil {
		b.Fatal(err)
	}
	frames := [][]byte{{}, PutSeq(1), p}
	var d Decoder
	b.ReportAllocs()
	b.SetBytes(int64(len(p)))
	for b.Loop() {
		if _, err := d.DecodeMessage(frames); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N*MaxEventsPerBatch)/b.Elapsed().Seconds(), "events/s")
}
