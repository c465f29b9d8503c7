package statedir

import "errors"

// EpochLen is the length of a publisher epoch (a random identity chosen
// when a gateway starts without usable state).
const EpochLen = 16

// Epoch is a publisher identity.
type Epoch [EpochLen]byte

// Position is how far the gateway has followed the master's change log:
// every change of Epoch up to Revision is reflected in what was published.
// The zero Position means "nothing followed yet; take a snapshot".
type Position struct {
	Epoch, Revision uint64
}

// Header describes a checkpoint: the announced set after every batch up
// to and including Seq was published.
type Header struct {
	PublisherEpoch Epoch
	// Seq is the last sequence number folded into the checkpoint (0: none).
	Seq uint64
	// Master is the master position of batch Seq.
	Master Position
	// LastEventID is the event_id of the last event published up to Seq,
	// so a restored publisher continues event ids too.
	LastEventID uint64
	// WrittenUnixMilli is when the checkpoint was written.
	WrittenUnixMilli int64
	// Subscribers is the number of PUB subscribers when it was written; a
	// restarted gateway waits (a bounded time) for as many to reconnect
	// before it publishes.
	Subscribers int
	// Entries is the number of (tenant, key, medium) entries that follow.
	Entries uint64
}

// Record is one journaled batch: the msgpack payload exactly as published
// (frame 2 of the PUB message), its sequence number and master position.
// A heartbeat (snapshot stream format) is a record whose payload holds no
// events.
type Record struct {
	Seq    uint64
	Master Position
	// LastEventID is the event_id of the batch's last event (for a
	// heartbeat, of the last event before it).
	LastEventID uint64
	UnixMilli   int64
	Payload     []byte
}

// ErrCorrupt reports state that failed its checks (a bad magic, version,
// checksum, length or order). Corrupt state is never trusted: the gateway
// moves it aside and starts a new publisher identity.
var ErrCorrupt = errors.New("statedir: corrupt state")
