package snapshot

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// chunkEncoder writes a reply's chunks: the payloads kvevent.Encoder's
// AppendBatch writes for stored events with event_id 0 and one timestamp,
// byte for byte, but from the key and group bytes of the set (no string
// per entry) and with everything else of an event copied whole. An event
// of a tenant and medium is
//
//	pre ‖ group (msgpack nil if empty, else str) ‖ mid ‖ key (str) ‖ tail
//
// where pre (map header … envelope, "group_id"), mid ("object_key") and
// tail are the same for every event of that tenant and medium: three
// copies and two string headers per event instead of a dozen appends.
//
// Nothing of the payload format is restated here: the constant parts are
// cut out of AppendBatch's own output for probe events, and every template
// is checked against AppendBatch for a sample event before it is used, so
// a change in pkg/kvevent's encoding fails a build loudly (ErrEncoding)
// instead of producing chunks that differ from the live stream's.
type chunkEncoder struct {
	enc *kvevent.Encoder
	ts  int64
	// head is a payload's start before the event array header (0x93 and
	// the timestamp), dp its end after the events (dp_rank).
	head, dp []byte

	// The template of the last tenant and medium (ok: built).
	ok             bool
	tenant         string
	medium         kvevent.Medium
	pre, mid, tail []byte
}

// ErrEncoding: kvevent's encoding of a stored event is not what
// chunkEncoder takes it to be (see chunkEncoder).
var ErrEncoding = errors.New("snapshot: chunk encoding differs from kvevent.Encoder's")

// reset prepares c for a reply at timestamp ts (ms).
func (c *chunkEncoder) reset(enc *kvevent.Encoder, ts int64) error {
	c.enc, c.ts, c.ok = enc, ts, false
	hb, err := enc.AppendHeartbeat(c.head[:0], ts) // head ‖ 0x90 ‖ dp
	if err != nil {
		return err
	}
	one, err := c.probe("t", kvevent.MediumCPU, "", "") // head ‖ 0x91 ‖ event ‖ dp
	if err != nil {
		return err
	}
	h := commonPrefix(hb, one)
	if h >= len(hb) || hb[h] != 0x90 || one[h] != 0x91 || !bytes.HasSuffix(one, hb[h+1:]) {
		return fmt.Errorf("%w: payload frame", ErrEncoding)
	}
	c.head, c.dp = hb[:h:h], append(c.dp[:0], hb[h+1:]...)
	return nil
}

// probe returns AppendBatch's payload of one stored event.
func (c *chunkEncoder) probe(tenant string, m kvevent.Medium, group, key string) ([]byte, error) {
	return c.enc.AppendBatch(nil, c.ts, []kvevent.Event{{Type: kvevent.Stored, Tenant: tenant, Medium: m, GroupID: group, Key: key}})
}

// event returns the event of a payload of one (see probe).
func (c *chunkEncoder) event(p []byte) ([]byte, bool) {
	n := len(c.head)
	if len(p) < n+1+len(c.dp) || !bytes.Equal(p[:n], c.head) || p[n] != 0x91 || !bytes.HasSuffix(p, c.dp) {
		return nil, false
	}
	return p[n+1 : len(p)-len(c.dp)], true
}

// use makes tenant and m the current template, building it if needed.
func (c *chunkEncoder) use(tenant string, m kvevent.Medium) error {
	if c.ok && c.medium == m && c.tenant == tenant {
		return nil
	}
	c.ok = false
	var evs [4][]byte // group and key: "" "", "g" "", "" "k", a sample
	for i, gk := range [4][2]string{{"", ""}, {"g", ""}, {"", "k"}, {"group-7", "sample/object/key/0123456789abcdef0123456789"}} {
		p, err := c.probe(tenant, m, gk[0], gk[1])
		if err != nil {
			return err
		}
		e, ok := c.event(p)
		if !ok {
			return fmt.Errorf("%w: payload of one event", ErrEncoding)
		}
		evs[i] = e
	}
	e, eg, ek := evs[0], evs[1], evs[2]
	// The group's value is where "" and "g" differ: nil (0xc0) against
	// fixstr "g"; the key's where "" and "k" do: fixstr "" against "k".
	p, q := commonPrefix(e, eg), commonPrefix(e, ek)
	if p >= q || q >= len(e) || e[p] != 0xc0 || e[q] != 0xa0 ||
		!bytes.Equal(eg[p:p+2], []byte{0xa1, 'g'}) || !bytes.Equal(eg[p+2:], e[p+1:]) ||
		!bytes.Equal(ek[q:q+2], []byte{0xa1, 'k'}) || !bytes.Equal(ek[q+2:], e[q+1:]) {
		return fmt.Errorf("%w: stored event layout", ErrEncoding)
	}
	c.pre = append(c.pre[:0], e[:p]...)
	c.mid = append(c.mid[:0], e[p+1:q]...)
	c.tail = append(c.tail[:0], e[q+1:]...)
	if got := c.appendEvent(nil, []byte("group-7"), []byte("sample/object/key/0123456789abcdef0123456789")); !bytes.Equal(got, evs[3]) {
		return fmt.Errorf("%w: sample event", ErrEncoding)
	}
	c.ok, c.tenant, c.medium = true, tenant, m
	return nil
}

// eventSize is the encoded size of an event of the current template.
func (c *chunkEncoder) eventSize(key, group []byte) int {
	n := len(c.pre) + len(c.mid) + len(c.tail) + strSize(len(key))
	if len(group) == 0 {
		return n + 1
	}
	return n + strSize(len(group))
}

// appendEvent appends an event of the current template.
func (c *chunkEncoder) appendEvent(b, group, key []byte) []byte {
	b = append(b, c.pre...)
	if len(group) == 0 {
		b = append(b, 0xc0)
	} else {
		b = append(appendStrHeader(b, len(group)), group...)
	}
	b = append(b, c.mid...)
	b = append(appendStrHeader(b, len(key)), key...)
	return append(b, c.tail...)
}

// appendChunkHead appends a payload's start for n (1..64) events.
func (c *chunkEncoder) appendChunkHead(b []byte, n int) []byte {
	b = append(b, c.head...)
	if n <= 15 {
		return append(b, 0x90|byte(n))
	}
	return append(b, 0xdc, byte(n>>8), byte(n))
}

// chunkHeadSize is the size appendChunkHead appends.
func (c *chunkEncoder) chunkHeadSize(n int) int {
	if n <= 15 {
		return len(c.head) + 1
	}
	return len(c.head) + 3
}

// msgpack str headers (https://github.com/msgpack/msgpack/blob/master/spec.md),
// the shortest form, as kvevent writes them (checked by use's sample and by
// TestChunkEncoderMatchesKvevent for every size class).

func strSize(n int) int {
	switch {
	case n <= 31:
		return 1 + n
	case n <= 0xff:
		return 2 + n
	case n <= 0xffff:
		return 3 + n
	default:
		return 5 + n
	}
}

func appendStrHeader(b []byte, n int) []byte {
	switch {
	case n <= 31:
		return append(b, 0xa0|byte(n))
	case n <= 0xff:
		return append(b, 0xd9, byte(n))
	case n <= 0xffff:
		return append(b, 0xda, byte(n>>8), byte(n))
	default:
		return append(b, 0xdb, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	}
}

func commonPrefix(a, b []byte) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}
