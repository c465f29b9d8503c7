package kvevent

import (
	"reflect"
	"testing"
)

// FuzzDecode feeds arbitrary frames to the strict decoder. It must never
// panic; whatever it accepts must be valid msgpack to an independent decoder
// (shamaton/msgpack) and must survive an encode/decode round trip unchanged.
func FuzzDecode(f *testing.F) {
	for _, legacy := range []bool{true, false} {
		enc := NewEncoder(EncoderOptions{Envelope: goldenEnvelope(), LegacyCompat: legacy, ObjectKey: true})
		p, err := enc.AppendBatch(nil, 1_700_000_000_000, goldenEvents())
		if err != nil {
			f.Fatal(err)
		}
		f.Add([]byte{}, PutSeq(1), p)
		f.Add([]byte{}, PutSeq(2), p[:len(p)-3])
	}
	f.Add([]byte{}, PutSeq(1), payload(mpMap(validKVs(Stored, false, 3))))
	f.Add([]byte("x"), []byte{1}, []byte{0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, topic, seq, p []byte) {
		var d Decoder
		b, err := d.DecodeMessage([][]byte{topic, seq, p})
		if err != nil {
			return
		}
		oracle(t, p)
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
	})
}
