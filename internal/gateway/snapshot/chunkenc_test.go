package snapshot

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/crescent-kv/crescent/internal/gateway/announced"
	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// TestChunkEncoderMatchesKvevent: every chunk of a reply is byte for byte
// what kvevent.Encoder.AppendBatch writes for its events (decoded back),
// under several encoder options, timestamps, string sizes of every msgpack
// str class and chunk sizes of every array header class.
func TestChunkEncoderMatchesKvevent(t *testing.T) {
	opts := []kvevent.EncoderOptions{
		{Envelope: kvevent.Envelope{BackendID: "b"}, ObjectKey: true},
		{Envelope: kvevent.Envelope{BackendID: "backend-a", ModelName: "m", BlockSize: 16, DPRank: 3}, LegacyCompat: true, ObjectKey: true},
		{Envelope: kvevent.Envelope{BackendID: strings.Repeat("B", 40), ModelName: strings.Repeat("M", 300), AdditionalSalt: "s", LoraName: "l", BlockSize: 70000, DPRank: math.MaxUint32}, LegacyCompat: true, ObjectKey: true},
	}
	keyLens := []int{1, 31, 32, 255, 256, 1000}
	groups := []string{"", "g", strings.Repeat("G", 31), strings.Repeat("G", 32), strings.Repeat("G", 300)}
	for oi, o := range opts {
		for _, ts := range []int64{0, 127, 128, 1 << 20, time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC).UnixMilli()} {
			for _, n := range []int{1, 15, 16, 64, 65, 64 + 15, 64 + 16, 400} {
				t.Run(fmt.Sprintf("opts%d/ts%d/n%d", oi, ts, n), func(t *testing.T) {
					cfg := testConfig()
					cfg.Encoder = o
					r, _ := newRecorder(t, cfg, Deps{Now: func() time.Time { return time.UnixMilli(ts) }})
					set := announced.New()
					for i := range n {
						tenant := []string{"t", "tenant-" + strings.Repeat("x", 40)}[i%2]
						key := fmt.Sprintf("%d/", i) + strings.Repeat("k", keyLens[i%len(keyLens)])
						set.Store(tenant, key, []kvevent.Medium{kvevent.MediumCPU, kvevent.MediumDisk}[i/2%2], groups[i%len(groups)])
					}
					r.Restore(testEpoch, 5, statedir.Position{}, 0, set)
					frames, _, err := r.build()
					if err != nil {
						t.Fatal(err)
					}
					rep := decodeReply(t, frames, o)
					if len(rep.set) != n || rep.cut != 5 {
						t.Fatalf("%d entries at cut %d", len(rep.set), rep.cut)
					}
					enc := kvevent.NewEncoder(o)
					for i, c := range frames[2:] {
						b := rep.chunks[i]
						evs := make([]kvevent.Event, len(b.Events))
						for j, e := range b.Events {
							evs[j] = kvevent.Event{Type: kvevent.Stored, Tenant: e.Tenant, Key: e.Key, Medium: e.Medium, GroupID: e.GroupID}
						}
						want, err := enc.AppendBatch(nil, ts, evs)
						if err != nil {
							t.Fatal(err)
						}
						if !bytes.Equal(c, want) {
							t.Fatalf("chunk %d of %d events: %d bytes, AppendBatch's %d differ at %d", i, len(evs), len(c), len(want), commonPrefix(c, want))
						}
					}
				})
			}
		}
	}
}

// TestChunkEncoderSegments: with tiny segments' worth of reply (a first
// segment estimate far too small), chunks that do not fit move to new
// segments whole.
func TestChunkEncoderSegments(t *testing.T) {
	cfg := testConfig()
	cfg.MaxReplyBytes = 1 << 30
	r, _ := newRecorder(t, cfg, Deps{})
	set := announced.New()
	ref := model{}
	for i := range 30000 {
		k := entry{"t", fmt.Sprintf("%06d/", i) + strings.Repeat("k", i%700), kvevent.MediumDisk}
		set.Store(k.tenant, k.key, k.medium, "g")
		ref[k] = "g"
	}
	r.Restore(testEpoch, 1, statedir.Position{}, 0, set)
	r.lastBytes = 100 // a first segment of about 1 KiB
	frames, _, err := r.build()
	if err != nil {
		t.Fatal(err)
	}
	ref.equal(t, decodeReply(t, frames, cfg.Encoder).set)
	if r.lastBytes < 10<<20 {
		t.Fatalf("reply of %d bytes, want more than a few segments", r.lastBytes)
	}
}

// TestChunkEncoderDetectsChanges: a template that does not match the
// encoder's output is refused (ErrEncoding), not used.
func TestChunkEncoderDetectsChanges(t *testing.T) {
	var c chunkEncoder
	if err := c.reset(kvevent.NewEncoder(testConfig().Encoder), 1); err != nil {
		t.Fatal(err)
	}
	if err := c.use("t", kvevent.MediumCPU); err != nil {
		t.Fatal(err)
	}
	c.head = append(c.head, 0) // as if the frame had changed
	c.ok = false
	if err := c.use("t", kvevent.MediumCPU); !errors.Is(err, ErrEncoding) {
		t.Fatalf("use with a wrong payload frame: %v", err)
	}
}
