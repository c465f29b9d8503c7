package publisher

import (
	"bytes"
	"slices"
	"testing"

	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
)

// FuzzSnapshotRequest: whatever a peer sends the snapshot socket, framing
// and envelope parsing never panic, and the envelope echoed is the
// request's frames up to its first empty one, or a lone delimiter.
func FuzzSnapshotRequest(f *testing.F) {
	f.Add(zmtp.AppendMessage(nil, nil, []byte("snapshot")))
	f.Add(zmtp.AppendMessage(nil, []byte("snapshot")))
	f.Add(zmtp.AppendMessage(nil, []byte("id"), nil, []byte("x")))
	f.Fuzz(func(t *testing.T, in []byte) {
		r := zmtp.NewReader(bytes.NewReader(in), replayLimits)
		for {
			m, err := r.ReadMessage()
			if err != nil {
				return
			}
			env := envelope(m.Frames)
			last := len(env) - 1
			if last < 0 || len(env[last]) != 0 || len(env) > len(m.Frames) {
				t.Fatalf("envelope %q of %q: want at most the request's frames, ending with an empty one", env, m.Frames)
			}
			for i, e := range env[:last] {
				if len(e) == 0 || !bytes.Equal(e, m.Frames[i]) {
					t.Fatalf("envelope %q is not the request's %q up to its first empty frame", env, m.Frames)
				}
			}
			if len(m.Frames[last]) != 0 && (len(env) != 1 || slices.ContainsFunc(m.Frames, func(f []byte) bool { return len(f) == 0 })) {
				t.Fatalf("envelope %q of %q: a lone delimiter only for a request without an empty frame", env, m.Frames)
			}
		}
	})
}
