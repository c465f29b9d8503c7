package publisher

import (
	"bytes"
	"testing"

	"github.com/crescent-kv/crescent/pkg/kvevent"
	"github.com/crescent-kv/crescent/pkg/kvevent/zmtp"
)

// FuzzReplayRequest: whatever a DEALER sends, the ROUTER's framing and
// request parsing never panic, and only the two request forms are accepted.
func FuzzReplayRequest(f *testing.F) {
	f.Add(zmtp.AppendMessage(nil, nil, kvevent.PutSeq(5)))
	f.Add(zmtp.AppendMessage(nil, kvevent.PutSeq(5)))
	f.Add(zmtp.AppendMessage(nil, []byte("x"), kvevent.PutSeq(5)))
	f.Fuzz(func(t *testing.T, in []byte) {
		r := zmtp.NewReader(bytes.NewReader(in), zmtp.Limits{MaxFrame: 256, MaxFrames: 4})
		for {
			m, err := r.ReadMessage()
			if err != nil {
				return
			}
			seq, ok := parseRequest(m.Frames)
			if !ok {
				continue
			}
			var f []byte
			switch len(m.Frames) {
			case 1:
				f = m.Frames[0]
			case 2:
				if len(m.Frames[0]) != 0 {
					t.Fatalf("accepted a request whose delimiter is %q", m.Frames[0])
				}
				f = m.Frames[1]
			default:
				t.Fatalf("accepted a %d-frame request", len(m.Frames))
			}
			if !bytes.Equal(f, kvevent.PutSeq(seq)) {
				t.Fatalf("parsed %d from %x", seq, f)
			}
		}
	})
}
