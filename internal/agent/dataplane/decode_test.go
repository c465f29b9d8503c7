package dataplane

import (
	"strconv"
	"strings"
	"testing"

	agentv1 "github.com/crescent-kv/crescent/gen/crescent/agent/v1"
	"github.com/crescent-kv/crescent/internal/rpccodec"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

const testSeg = "6c3d1b7e-2f4a-4e8b-9c0d-1a2b3c4d5e6f"

// checkSameTransfer decodes b as internal/xfer does (rpccodec.Unmarshal) into a
// plain TransferRequest and through the connection's pooled, unsafe decoder
// (after a first request, so its items are reused), and compares.
func checkSameTransfer(t *testing.T, b []byte) {
	t.Helper()
	plain := &agentv1.TransferRequest{}
	plainErr := rpccodec.Unmarshal(b, plain)
	w := &transferRequest{TransferRequest: &agentv1.TransferRequest{}}
	if err := rpccodec.Unmarshal(prev, w); err != nil {
		t.Fatal(err)
	}
	w.TransferRequest = &agentv1.TransferRequest{}
	fastErr := rpccodec.Unmarshal(b, w)
	if (plainErr == nil) != (fastErr == nil) || (plainErr != nil && plainErr.Error() != fastErr.Error()) {
		t.Fatalf("decode of %x: generated err %v, fast path err %v", b, plainErr, fastErr)
	}
	if plainErr == nil && !proto.Equal(plain, w.TransferRequest) {
		t.Fatalf("decode of %x:\ngenerated %v\nfast path %v", b, plain, w.TransferRequest)
	}
}

// prev is a request decoded before the one under test, so that the
// decoder reuses its items.
var prev = func() []byte {
	b, err := rpccodec.AppendMarshal(nil, transferMsg(3))
	if err != nil {
		panic(err)
	}
	return b
}()

func transferMsg(n int) *agentv1.TransferRequest {
	items := make([]*agentv1.TransferItem, n)
	for i := range items {
		items[i] = &agentv1.TransferItem{SegmentId: testSeg, AllocationId: uint64(i) << 20, Token: []byte("token-" + strconv.Itoa(i)), Offset: uint64(i % 7), Length: 4096}
	}
	items = append(items, &agentv1.TransferItem{SegmentId: "other", Token: []byte{}}, &agentv1.TransferItem{})
	return &agentv1.TransferRequest{Op: agentv1.TransferOp_TRANSFER_OP_WRITE, Items: items}
}

func transferSeeds(t testing.TB) [][]byte {
	m := func(msg proto.Message) []byte {
		b, err := rpccodec.AppendMarshal(nil, msg)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	one := m(transferMsg(2))
	seeds := [][]byte{one, m(&agentv1.TransferRequest{Op: 77}), m(&agentv1.TransferRequest{}), append(append([]byte(nil), one...), one...)}
	// Unknown field, wrong wire type, invalid UTF-8, a negative enum.
	item := protowire.AppendTag(nil, 9, protowire.Fixed32Type)
	item = protowire.AppendFixed32(item, 1)
	seeds = append(seeds, protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), item))
	wrong := protowire.AppendTag(nil, 3, protowire.VarintType)
	wrong = protowire.AppendVarint(wrong, 5)
	seeds = append(seeds, protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), wrong))
	bad := m(&agentv1.TransferRequest{Items: []*agentv1.TransferItem{{SegmentId: "ab"}}})
	bad[len(bad)-1] = 0xfe
	seeds = append(seeds, bad, protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), 1<<63|1<<31))
	// Spares' items naming a key (field 7): ordinary, long, not UTF-8, and
	// repeated in one item (the last wins).
	keyed := transferMsg(2)
	keyed.Items[0].Key, keyed.Items[0].SealChecksum = "obj/1", proto.Uint64(7)
	keyed.Items[1].Key = strings.Repeat("k", 2000)
	seeds = append(seeds, m(keyed))
	badKey := m(&agentv1.TransferRequest{Items: []*agentv1.TransferItem{{Key: "ab"}}})
	badKey[len(badKey)-1] = 0xff
	seeds = append(seeds, badKey)
	twice := protowire.AppendString(protowire.AppendTag(nil, 7, protowire.BytesType), "first")
	twice = protowire.AppendString(protowire.AppendTag(twice, 7, protowire.BytesType), "second")
	seeds = append(seeds, protowire.AppendBytes(protowire.AppendTag(nil, 2, protowire.BytesType), twice))
	return seeds
}

// TestTransferRequestDecode checks the fast path against the generated
// decoder on valid headers, odd but valid encodings and malformed ones.
func TestTransferRequestDecode(t *testing.T) {
	for _, b := range transferSeeds(t) {
		checkSameTransfer(t, b)
		for i := range b {
			checkSameTransfer(t, b[:i])
		}
	}
	b, err := rpccodec.AppendMarshal(nil, transferMsg(128))
	if err != nil {
		t.Fatal(err)
	}
	w := &transferRequest{TransferRequest: &agentv1.TransferRequest{}}
	allocs := testing.AllocsPerRun(20, func() {
		if err := rpccodec.Unmarshal(b, w); err != nil {
			t.Fatal(err)
		}
	})
	// A connection's second request of the same size reuses every item,
	// and ids and tokens point into the header.
	if allocs > 2 {
		t.Fatalf("decoding a header of 130 items took %v allocations", allocs)
	}
}

// FuzzTransferRequestDecode: whatever the bytes, the connection's decoder
// decodes (or refuses) exactly as the standard one does.
func FuzzTransferRequestDecode(f *testing.F) {
	for _, b := range transferSeeds(f) {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) { checkSameTransfer(t, b) })
}
