package kvevent

import (
	"bytes"
	"encoding/binary"
	"errors"
	"reflect"
	"testing"
)

// FuzzDecode feeds arbitrary frames to the strict decoder. It must never
// panic; whatever it accepts must be valid msgpack to an independent decoder
// (shamaton/msgpack) and must survive an encode/decode round trip unchanged.
// Both sequence frame shapes are covered: 8 bytes (Mooncake) and 24 bytes
// (snapshot format: sequence and epoch), where an empty event array is a
// heartbeat.
func FuzzDecode(f *testing.F) {
	epoch := bytes.Repeat([]byte{0xe7}, EpochLen)
	for _, legacy := range []bool{true, false} {
		enc := NewEncoder(EncoderOptions{Envelope: goldenEnvelope(), LegacyCompat: legacy, ObjectKey: true})
		p, err := enc.AppendBatch(nil, 1_700_000_000_000, goldenEvents())
		if err != nil {
			f.Fatal(err)
		}
		f.Add([]byte{}, PutSeq(1), p)
		f.Add([]byte{}, PutSeq(2), p[:len(p)-3])
		f.Add([]byte{}, PutSeqEpoch(3, epoch), p)
		hb, err := enc.AppendHeartbeat(nil, 1_700_000_000_000)
		if err != nil {
			f.Fatal(err)
		}
		f.Add([]byte{}, PutSeqEpoch(4, epoch), hb)
		f.Add([]byte{}, PutSeq(4), hb)
	}
	f.Add([]byte{}, PutSeq(1), payload(mpMap(validKVs(Stored, false, 3))))
	f.Add([]byte{}, PutSeqEpoch(0, epoch), []byte{0x93, 0xcb, 0x41, 0xd9, 0x00, 0, 0, 0, 0, 0, 0x90, 0x00}) // vLLM's float ts
	f.Add([]byte("x"), []byte{1}, []byte{0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, topic, seq, p []byte) {
		var d Decoder
		b, err := d.DecodeMessage([][]byte{topic, seq, p})
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		oracle(t, p)
		switch len(seq) {
		case 8:
			if b.Epoch != nil || b.Heartbeat() || b.Seq != binary.BigEndian.Uint64(seq) {
				t.Fatalf("8-byte frame: batch %+v (an epoch or a heartbeat)", b)
			}
		case 8 + EpochLen:
			if !bytes.Equal(b.Epoch, seq[8:]) || b.Seq != binary.BigEndian.Uint64(seq) {
				t.Fatalf("24-byte frame %x: seq %d epoch %x", seq, b.Seq, b.Epoch)
			}
		default:
			t.Fatalf("accepted a %d-byte sequence frame", len(seq))
		}
		if b.Heartbeat() {
			re, err := NewEncoder(EncoderOptions{Envelope: Envelope{DPRank: b.DPRank}}).AppendHeartbeat(nil, b.Timestamp)
			if err != nil {
				t.Fatal(err)
			}
			b2, err := (&Decoder{AllowEmpty: true}).DecodePayload(b.Seq, re)
			if err != nil || !b2.Heartbeat() || b2.Timestamp != b.Timestamp || b2.DPRank != b.DPRank {
				t.Fatalf("heartbeat round trip: %+v, %v; want %+v", b2, err, b)
			}
		}
		roundTrip(t, b)
	})
}

// roundTrip re-encodes each event of b alone and checks it decodes back
// unchanged.
func roundTrip(t *testing.T, b Batch) {
	t.Helper()
	for i, ev := range b.Events {
		enc := NewEncoder(EncoderOptions{Envelope: ev.Envelope, LegacyCompat: ev.Legacy, ObjectKey: true})
		re, err := enc.AppendBatch(nil, b.Timestamp, []Event{ev})
		if err != nil {
			t.Fatalf("event %d: re-encode: %v", i, err)
		}
		var d2 Decoder
		b2, err := d2.DecodePayload(b.Seq, re)
		if err != nil {
			t.Fatalf("event %d: re-decode: %v", i, err)
		}
		got := b2.Events[0]
		if !reflect.DeepEqual(got, ev) {
			t.Fatalf("event %d: round trip\n got %+v\nwant %+v", i, got, ev)
		}
	}
}

// FuzzDecodeSnapshotReply feeds arbitrary frames to the snapshot reply
// decoder: never a panic; an error is ErrMalformed, or
// ErrSnapshotUnavailable for exactly [-2, epoch]; an accepted reply keeps
// every rule (cut >= -1, a 16-byte epoch, no chunks at -1, 1..64 stored
// events with event_id 0 per chunk) and its events round-trip.
func FuzzDecodeSnapshotReply(f *testing.F) {
	epoch := bytes.Repeat([]byte{0x5a}, EpochLen)
	cut := func(c int64) []byte { return binary.BigEndian.AppendUint64(nil, uint64(c)) }
	for _, legacy := range []bool{true, false} {
		enc := NewEncoder(EncoderOptions{Envelope: goldenEnvelope(), LegacyCompat: legacy, ObjectKey: true})
		evs := []Event{
			{Type: Stored, Tenant: "t", Key: "a", Medium: MediumCPU, GroupID: "g"},
			{Type: Stored, Tenant: "t", Key: "b", Medium: MediumDisk},
		}
		c, err := enc.AppendBatch(nil, 1_700_000_000_000, evs)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(cut(41), epoch, c, c, uint8(2))
		f.Add(cut(41), epoch, c, c[:len(c)-1], uint8(2))
	}
	f.Add(cut(-1), epoch, []byte{}, []byte{}, uint8(0))
	f.Add(cut(-2), epoch, []byte{}, []byte{}, uint8(0))
	f.Add(cut(-2), epoch, []byte{0x90}, []byte{}, uint8(1))
	f.Add(cut(7), epoch[:15], []byte{}, []byte{}, uint8(0))
	f.Add([]byte{1}, epoch, []byte{}, []byte{}, uint8(0))
	f.Fuzz(func(t *testing.T, cutF, epochF, c1, c2 []byte, n uint8) {
		frames := [][]byte{cutF, epochF, c1, c2}[:2+int(n%3)]
		s, err := DecodeSnapshotReply(frames)
		if err != nil {
			unavailable := len(cutF) == 8 && int64(binary.BigEndian.Uint64(cutF)) == CutUnavailable && len(epochF) == EpochLen && len(frames) == 2
			switch {
			case errors.Is(err, ErrSnapshotUnavailable) != unavailable:
				t.Fatalf("frames %x: error %v (unavailable reply: %v)", frames, err, unavailable)
			case !unavailable && !errors.Is(err, ErrMalformed):
				t.Fatalf("error %v does not wrap ErrMalformed", err)
			}
			return
		}
		if s.Cut < CutNone || len(s.Epoch) != EpochLen || !bytes.Equal(s.Epoch, epochF) || (s.Cut == CutNone && len(s.Batches) != 0) || len(s.Batches) != len(frames)-2 {
			t.Fatalf("accepted %x as %+v", frames, s)
		}
		for i, b := range s.Batches {
			oracle(t, frames[2+i])
			if !b.Snapshot || b.Seq != uint64(s.Cut) || len(b.Events) == 0 || len(b.Events) > MaxEventsPerBatch || !bytes.Equal(b.Epoch, s.Epoch) {
				t.Fatalf("chunk %d: %+v", i, b)
			}
			for _, ev := range b.Events {
				if ev.Type != Stored || ev.ID != 0 {
					t.Fatalf("chunk %d holds %+v", i, ev)
				}
			}
			roundTrip(t, b)
		}
	})
}
