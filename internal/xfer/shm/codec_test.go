package shm

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/rpcerr"
	"github.com/crescent-kv/crescent/internal/xfer"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestHelloRoundTrip(t *testing.T) {
	segs := []Segment{{ID: "a", Size: 1 << 20}, {ID: "0f6c2a3e-uuid", Size: 64 << 20}}
	b, err := AppendHello(nil, segs)
	if err != nil {
		t.Fatal(err)
	}
	got, err := ReadHello(bytes.NewReader(b))
	if err != nil || len(got) != 2 || got[0] != segs[0] || got[1] != segs[1] {
		t.Fatalf("ReadHello = %v, %v", got, err)
	}
	if _, err := AppendHello(nil, make([]Segment, MaxSegments+1)); err == nil {
		t.Fatal("a hello of too many segments")
	}
	ref, _ := AppendRefusal(nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_LIMIT_EXCEEDED, "full"))
	if _, err := ReadHello(bytes.NewReader(ref)); rpcerr.Reason(err) != "LIMIT_EXCEEDED" {
		t.Fatalf("refused hello = %v", err)
	}
}

func TestGrantRoundTrip(t *testing.T) {
	resp := &agentv1.TransferResponse{Results: []*agentv1.TransferResult{{Length: 5, ObjectSize: 5, Checksum: 7}, {Status: &agentv1.ItemResult{Code: 5, Reason: "NOT_FOUND"}}}}
	b, err := AppendGrant(nil, resp, []uint64{4096, 0})
	if err != nil {
		t.Fatal(err)
	}
	got := &agentv1.TransferResponse{}
	offs, _, err := ReadGrant(bytes.NewReader(b), nil, got, 2, nil)
	if err != nil || len(offs) != 2 || offs[0] != 4096 || got.GetResults()[0].GetChecksum() != 7 {
		t.Fatalf("ReadGrant = %v, %v, %v", offs, got, err)
	}
	if _, _, err := ReadGrant(bytes.NewReader(b), nil, &agentv1.TransferResponse{}, 3, nil); !errors.Is(err, xfer.ErrProtocol) {
		t.Fatalf("a grant of the wrong count = %v", err)
	}
	if _, _, err := ReadGrant(bytes.NewReader(b[:len(b)-1]), nil, &agentv1.TransferResponse{}, 2, nil); err == nil {
		t.Fatal("a grant cut short")
	}
	if _, err := ReadDone(bytes.NewReader(Release), nil, &agentv1.TransferResponse{}, 2); err != nil {
		t.Fatalf("ReadDone(Release) = %v", err)
	}
	// A release answered with the seals of the items that asked: one
	// result per item, or none; a grant's fields in it are refused.
	sealed, _ := xfer.AppendFrame(nil, &agentv1.TransferResponse{Results: []*agentv1.TransferResult{{SealReceipt: []byte("r")}, {}}})
	done := &agentv1.TransferResponse{}
	if _, err := ReadDone(bytes.NewReader(sealed), nil, done, 2); err != nil || string(done.GetResults()[0].GetSealReceipt()) != "r" {
		t.Fatalf("ReadDone(seals) = %v, %v", done, err)
	}
	if _, err := ReadDone(bytes.NewReader(sealed), nil, &agentv1.TransferResponse{}, 3); !errors.Is(err, xfer.ErrProtocol) {
		t.Fatalf("seals of the wrong count = %v", err)
	}
	if _, err := ReadDone(bytes.NewReader(b), nil, &agentv1.TransferResponse{}, 2); !errors.Is(err, xfer.ErrProtocol) {
		t.Fatalf("a grant as the release's answer = %v", err)
	}
}

func TestHelloLimits(t *testing.T) {
	// An id longer than MaxSegmentIDBytes is refused before its bytes are read.
	resp := &agentv1.TransferResponse{Results: []*agentv1.TransferResult{{Length: MaxSegmentIDBytes + 1, ObjectSize: 1}}}
	b, _ := xfer.AppendFrame(nil, resp)
	if _, err := ReadHello(bytes.NewReader(b)); !errors.Is(err, xfer.ErrProtocol) {
		t.Fatalf("long id = %v", err)
	}
	var big [4]byte
	binary.LittleEndian.PutUint32(big[:], MaxHelloHeaderBytes+1)
	if _, err := ReadHello(bytes.NewReader(big[:])); !errors.Is(err, xfer.ErrProtocol) {
		t.Fatalf("oversized hello header = %v", err)
	}
}

// FuzzDecode feeds arbitrary bytes to every decoder of the protocol's
// client side (hello, grant, release answer): no panic, no allocation
// beyond the limits, and what decodes keeps the invariants.
func FuzzDecode(f *testing.F) {
	hello, _ := AppendHello(nil, []Segment{{ID: "seg", Size: 4096}})
	grant, _ := AppendGrant(nil, &agentv1.TransferResponse{Results: []*agentv1.TransferResult{{Length: 1}}}, []uint64{8})
	ref, _ := AppendRefusal(nil, rpcerr.Errorf(masterv1.ErrorReason_ERROR_REASON_INVALID_PARAMS, "no"))
	for _, s := range [][]byte{hello, grant, ref, Release, {}, {1, 0, 0, 0, 0x12}} {
		f.Add(s, uint8(1))
	}
	f.Fuzz(func(t *testing.T, b []byte, n uint8) {
		if segs, err := ReadHello(bytes.NewReader(b)); err == nil {
			if len(segs) > MaxSegments {
				t.Fatalf("%d segments", len(segs))
			}
			for _, s := range segs {
				if len(s.ID) == 0 || len(s.ID) > MaxSegmentIDBytes || s.Size == 0 {
					t.Fatalf("segment %+v", s)
				}
			}
		}
		resp := &agentv1.TransferResponse{}
		if offs, _, err := ReadGrant(bytes.NewReader(b), nil, resp, int(n), nil); err == nil {
			if len(offs) != int(n) || len(resp.GetResults()) != int(n) {
				t.Fatalf("%d offsets, %d results for %d items", len(offs), len(resp.GetResults()), n)
			}
		}
		done := &agentv1.TransferResponse{}
		if _, err := ReadDone(bytes.NewReader(b), nil, done, int(n)); err == nil {
			if k := len(done.GetResults()); k != 0 && k != int(n) {
				t.Fatalf("release of %d items answered with %d results", n, k)
			}
		}
	})
}
