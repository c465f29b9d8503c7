package kvevent

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/shamaton/msgpack/v2"
)

var update = flag.Bool("update", false, "rewrite testdata/golden files")

// oracle decodes b with shamaton/msgpack, an independent msgpack
// implementation, so the golden tests do not trust our own decoder.
func oracle(t testing.TB, b []byte) any {
	t.Helper()
	var v any
	if err := msgpack.Unmarshal(b, &v); err != nil {
		t.Fatalf("shamaton/msgpack cannot decode %x: %v", b, err)
	}
	return v
}

// describe renders a decoded msgpack value with its wire type, keys sorted,
// so that golden files pin both values and types (int vs float, nil vs "").
func describe(v any, indent string) string {
	switch x := v.(type) {
	case nil:
		return "nil"
	case string:
		return fmt.Sprintf("str %q", x)
	case uint8, uint16, uint32, uint64, int8, int16, int32, int64:
		return fmt.Sprintf("int %v", x)
	case float32, float64:
		return fmt.Sprintf("FLOAT %v", x)
	case bool:
		return fmt.Sprintf("bool %v", x)
	case []byte:
		return fmt.Sprintf("BIN %x", x)
	case []any:
		if len(x) == 0 {
			return "[]"
		}
		var sb strings.Builder
		sb.WriteString("[\n")
		for _, e := range x {
			sb.WriteString(indent + "  " + describe(e, indent+"  ") + "\n")
		}
		sb.WriteString(indent + "]")
		return sb.String()
	case map[any]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			ks, ok := k.(string)
			if !ok {
				return fmt.Sprintf("NON-STRING KEY %T", k)
			}
			keys = append(keys, ks)
		}
		slices.Sort(keys)
		var sb strings.Builder
		sb.WriteString("{\n")
		for _, k := range keys {
			sb.WriteString(fmt.Sprintf("%s  %s: %s\n", indent, k, describe(x[k], indent+"  ")))
		}
		sb.WriteString(indent + "}")
		return sb.String()
	default:
		return fmt.Sprintf("UNEXPECTED %T", v)
	}
}

// The exact field sets of the contract, written out independently of the
// decoder's tables.
var (
	contractEnvelope = []string{"event_id", "timestamp", "event_type", "model_name", "block_size",
		"additional_salt", "lora_name", "tenant_id", "backend_id", "medium", "dp_rank"}
	contractPerObject = []string{"group_id", "object_key", "seq_hashes", "base_block_idx"}
)

func contractKeys(t EventType, legacy bool) []string {
	keys := slices.Clone(contractEnvelope)
	if legacy {
		keys = append(keys, "type")
	}
	if t.PerObject() {
		keys = append(keys, contractPerObject...)
		if legacy {
			keys = append(keys, "block_hashes")
		}
	}
	if t == Stored {
		keys = append(keys, "parent_hash", "token_ids")
		if legacy {
			keys = append(keys, "parent_block_hash")
		}
	}
	slices.Sort(keys)
	return keys
}

func goldenEnvelope() Envelope {
	return Envelope{BackendID: "gw-1", ModelName: "llama-3-8b", BlockSize: 16, DPRank: 2}
}

func goldenEvents() []Event {
	return []Event{
		{ID: 7, Type: Stored, Tenant: "t1", Key: "k/0001", Medium: MediumCPU, GroupID: "g1"},
		{ID: 8, Type: Removed, Tenant: "t1", Key: "k/0001", Medium: MediumDisk},
		{ID: 9, Type: Cleared, Tenant: "t1"},
	}
}

func TestGoldenFieldSets(t *testing.T) {
	const ts = 1_700_000_000_123
	for _, legacy := range []bool{true, false} {
		for _, objectKey := range []bool{true, false} {
			name := fmt.Sprintf("legacy=%v,object_key=%v", legacy, objectKey)
			t.Run(name, func(t *testing.T) {
				enc := NewEncoder(EncoderOptions{Envelope: goldenEnvelope(), LegacyCompat: legacy, ObjectKey: objectKey})
				var evs []Event
				for _, ev := range goldenEvents() {
					if got, want := enc.Emits(ev.Type), objectKey || ev.Type == Cleared; got != want {
						t.Fatalf("Emits(%s) = %v, want %v", ev.Type, got, want)
					}
					if enc.Emits(ev.Type) {
						evs = append(evs, ev)
					}
				}
				payload, err := enc.AppendBatch(nil, ts, evs)
				if err != nil {
					t.Fatalf("AppendBatch: %v", err)
				}
				v := oracle(t, payload)
				top, ok := v.([]any)
				if !ok || len(top) != 3 {
					t.Fatalf("payload = %s, want a 3-element array", describe(v, ""))
				}
				maps, ok := top[1].([]any)
				if !ok || len(maps) != len(evs) {
					t.Fatalf("events = %s, want %d maps", describe(top[1], ""), len(evs))
				}
				for i, m := range maps {
					mm := m.(map[any]any)
					var got []string
					for k := range mm {
						got = append(got, k.(string))
					}
					slices.Sort(got)
					if want := contractKeys(evs[i].Type, legacy); !slices.Equal(got, want) {
						t.Errorf("%s keys =\n  %v\nwant\n  %v", evs[i].Type, got, want)
					}
				}
				// The whole decoded structure, types included, is pinned by a golden file.
				got := describe(v, "") + "\n"
				path := filepath.Join("testdata", "golden", fmt.Sprintf("legacy_%v_objectkey_%v.txt", legacy, objectKey))
				if *update {
					if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
						t.Fatal(err)
					}
					if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
						t.Fatal(err)
					}
				}
				want, err := os.ReadFile(path)
				if err != nil {
					t.Fatalf("read golden (run with -update to create): %v", err)
				}
				if got != string(want) {
					t.Errorf("decoded payload differs from %s:\ngot:\n%s\nwant:\n%s", path, got, want)
				}
				// Our strict decoder accepts what we encode and returns it verbatim.
				b, err := DecodeMessage([][]byte{nil, PutSeq(5), payload})
				if err != nil {
					t.Fatalf("DecodeMessage: %v", err)
				}
				if b.Seq != 5 || b.Timestamp != ts || b.DPRank != 2 || len(b.Events) != len(evs) {
					t.Fatalf("batch = seq %d ts %d dp %d n %d", b.Seq, b.Timestamp, b.DPRank, len(b.Events))
				}
				for i, ev := range b.Events {
					want := evs[i]
					want.Timestamp = ts
					want.Envelope = goldenEnvelope()
					want.Legacy = legacy
					if !reflect.DeepEqual(ev, want) {
						t.Errorf("event %d = %+v, want %+v", i, ev, want)
					}
				}
			})
		}
	}
}

func TestEncodeNullsAndIntegers(t *testing.T) {
	// An envelope with every nullable value unset encodes nils, and large
	// ids/timestamps stay integers in every width.
	enc := NewEncoder(EncoderOptions{Envelope: Envelope{BackendID: "b"}, LegacyCompat: true, ObjectKey: true})
	for _, id := range []uint64{0, 127, 128, 255, 256, 65535, 65536, 1<<32 - 1, 1 << 32, 1<<64 - 1} {
		payload, err := enc.AppendBatch(nil, int64(id>>1), []Event{{ID: id, Type: Stored, Tenant: "", Key: "", Medium: MediumCPU}})
		if err != nil {
			t.Fatal(err)
		}
		top := oracle(t, payload).([]any)
		ev := top[1].([]any)[0].(map[any]any)
		for _, k := range []string{"model_name", "additional_salt", "lora_name", "block_size", "group_id"} {
			if v, ok := ev[k]; !ok || v != nil {
				t.Errorf("id %d: %s = %v (present %v), want nil present", id, k, v, ok)
			}
		}
		for _, k := range []string{"event_id", "timestamp"} {
			if d := describe(ev[k], ""); !strings.HasPrefix(d, "int ") {
				t.Errorf("id %d: %s = %s, want an integer", id, k, d)
			}
		}
		if d := describe(top[0], ""); !strings.HasPrefix(d, "int ") {
			t.Errorf("timestamp_ms = %s, want an integer", d)
		}
		b, err := DecodeMessage([][]byte{{}, PutSeq(1), payload})
		if err != nil {
			t.Fatalf("id %d: decode: %v", id, err)
		}
		if got := b.Events[0].ID; got != id {
			t.Errorf("decoded id = %d, want %d", got, id)
		}
	}
}

func TestEncodeLongStrings(t *testing.T) {
	enc := NewEncoder(EncoderOptions{Envelope: Envelope{BackendID: strings.Repeat("b", 300)}, ObjectKey: true})
	for _, n := range []int{0, 31, 32, 255, 256, 65535, 65536, 70000} {
		key := strings.Repeat("k", n)
		payload, err := enc.AppendBatch(nil, 1, []Event{{ID: 1, Type: Removed, Tenant: "t", Key: key, Medium: MediumDisk}})
		if err != nil {
			t.Fatal(err)
		}
		ev := oracle(t, payload).([]any)[1].([]any)[0].(map[any]any)
		if got := ev["object_key"]; got != key {
			t.Errorf("len %d: oracle object_key has len %d", n, len(got.(string)))
		}
		b, err := DecodeMessage([][]byte{{}, PutSeq(1), payload})
		if err != nil {
			t.Fatalf("len %d: %v", n, err)
		}
		if b.Events[0].Key != key {
			t.Errorf("len %d: decoded key mismatch", n)
		}
	}
}

func TestAppendBatchRejects(t *testing.T) {
	enc := NewEncoder(EncoderOptions{Envelope: Envelope{BackendID: "b"}, ObjectKey: true})
	many := make([]Event, 65)
	for i := range many {
		many[i] = Event{ID: uint64(i + 1), Type: Cleared, Tenant: "t"}
	}
	tests := []struct {
		name string
		ts   int64
		evs  []Event
	}{
		{"empty", 1, nil},
		{"65 events", 1, many},
		{"negative timestamp", -1, many[:1]},
		{"unknown type", 1, []Event{{ID: 1, Tenant: "t"}}},
		{"stored without medium", 1, []Event{{ID: 1, Type: Stored, Tenant: "t", Key: "k"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := enc.AppendBatch(nil, tt.ts, tt.evs); err == nil {
				t.Errorf("AppendBatch(%s) = nil error, want an error", tt.name)
			}
		})
	}
}
