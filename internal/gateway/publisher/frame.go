package publisher

import (
	"encoding/binary"
	"fmt"

	"github.com/crescent-kv/crescent/internal/gateway/statedir"
)

// Format is the stream's framing dialect.
type Format uint8

const (
	// FormatMooncake is the contract's stream: an 8-byte sequence frame,
	// no heartbeats.
	FormatMooncake Format = iota
	// FormatSnapshot is the dialect of vLLM's state snapshots (PR #57789,
	// consumed by llm-d's snapshot recovery): the sequence frame is the
	// 8-byte sequence followed by the 16-byte publisher epoch, and an idle
	// publisher sends heartbeats (batches with no events). The payload is
	// the contract's, unchanged.
	FormatSnapshot
)

// String is the format's flag spelling.
func (f Format) String() string {
	switch f {
	case FormatMooncake:
		return "mooncake"
	case FormatSnapshot:
		return "snapshot"
	default:
		return fmt.Sprintf("Format(%d)", uint8(f))
	}
}

// MarshalText makes the status JSON say "mooncake" or "snapshot".
func (f Format) MarshalText() ([]byte, error) { return []byte(f.String()), nil }

// ParseFormat parses "mooncake" or "snapshot".
func ParseFormat(s string) (Format, error) {
	switch s {
	case "mooncake":
		return FormatMooncake, nil
	case "snapshot":
		return FormatSnapshot, nil
	}
	return 0, fmt.Errorf("stream format %q: want mooncake or snapshot", s)
}

// seqSuffix is the bytes after the 8-byte sequence in a sequence frame.
func (f Format) seqSuffix() int {
	if f == FormatSnapshot {
		return statedir.EpochLen
	}
	return 0
}

// wireHeadroom fits the frame headers of [topic, seq, payload] in either
// format with the empty topic: 2 for the topic, 2+8+16 for the longest
// sequence frame, 9 for a long payload header. A topic adds its length
// (headroom).
const wireHeadroom = 2 + 2 + 8 + statedir.EpochLen + 9

// MaxTopicLen bounds Config.Topic: the topic frame keeps a 1-byte size, so
// the headroom is wireHeadroom + len(topic).
const MaxTopicLen = 255

// headroom is the room frameMessage needs in front of a payload for topic.
func headroom(topic string) int { return wireHeadroom + len(topic) }

// frameInPlace writes the ZMTP headers of [b"", seq, payload] in front of
// the payload at buf[wireHeadroom:] and returns the message's wire bytes
// (identical to zmtp.AppendMessage(nil, nil, seq8, payload)).
func frameInPlace(buf []byte, seq uint64) []byte { return frameMessage(buf, "", seq, nil) }

// frameSeq is frameInPlace with suffix after the 8-byte sequence (the
// epoch in FormatSnapshot: [b"", seq8 || suffix, payload]).
func frameSeq(buf []byte, seq uint64, suffix []byte) []byte {
	return frameMessage(buf, "", seq, suffix)
}

// frameMessage writes the ZMTP headers of [topic, seq8 || suffix, payload]
// in front of the payload at buf[headroom(topic):], in place, and returns
// the message's wire bytes (a suffix of buf). topic is at most MaxTopicLen
// bytes.
func frameMessage(buf []byte, topic string, seq uint64, suffix []byte) []byte {
	room := headroom(topic)
	n := len(buf) - room
	seqLen := 8 + len(suffix)
	start := room - (2 + len(topic) + 2 + seqLen + frameHeaderLen(n))
	w := append(buf[start:start], 0x01, byte(len(topic))) // topic: MORE, short
	w = append(w, topic...)
	w = appendFrameHeader(w, true, seqLen)
	w = binary.BigEndian.AppendUint64(w, seq)
	w = append(w, suffix...)
	appendFrameHeader(w, false, n) // fills buf up to room, in place
	return buf[start:]
}

// frameHeaderLen is the size of a data frame header for an n-byte body.
func frameHeaderLen(n int) int {
	if n > 255 {
		return 9
	}
	return 2
}

// appendFrameHeader appends a data frame's header (ZMTP 3: flags, then a
// 1- or 8-byte size).
func appendFrameHeader(dst []byte, more bool, n int) []byte {
	var flags byte
	if more {
		flags = 0x01
	}
	if n > 255 {
		return binary.BigEndian.AppendUint64(append(dst, flags|0x02), uint64(n))
	}
	return append(dst, flags, byte(n))
}
