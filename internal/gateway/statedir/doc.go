// Package statedir is the gateway's persisted publisher state (issue 13):
// a checkpoint of the announced set at a sequence number, and a journal
// of every batch published since, each written before the batch is sent.
// Together they let a restarted gateway continue its sequence, keep its
// publisher epoch, restore its replay ring, and publish only the
// difference from the master. See docs/gateway-state.md.
//
// # Use
//
// A gateway starting up:
//
//	d, err := statedir.Open(dir, opts, lg)            // takes dir/LOCK
//	h, found, err := d.LoadCheckpoint(fold)           // the announced set
//	err = d.Replay(h.PublisherEpoch, h.Seq, apply)    // batches after it
//	ring, err := d.Tail(h.PublisherEpoch, n, bytes)   // the replay ring
//	// Any ErrCorrupt, or no checkpoint: d.Reset(why); e := NewEpoch();
//	// d.WriteCheckpoint(Header{PublisherEpoch: e}, nil) records e.
//	j, err := d.OpenJournal(epoch)                    // then j.Append per batch
//	...
//	j.Sync() when idle; at stop: d.WriteCheckpoint(...), d.Close()
//
// Replay (or Tail) must run before OpenJournal: it truncates a torn tail of
// the newest journal file, which must happen before a new file is started
// after it (a torn record in any file but the newest is corruption).
// OpenJournal runs the same checks itself when neither was called, and
// Replay and Tail refuse to run while a journal is open.
//
// # Concurrency
//
// One goroutine appends to the Journal (the publisher); Journal.Sync may be
// called from another. WriteCheckpoint may run on another goroutine (the
// recorder) while the journal is appended to. The Dir's own operations are
// serialised by Dir.mu (held during their I/O; they are rare). Lock order:
// Dir.mu before Journal.mu; Journal.Close takes them one after the other.
// The package starts no goroutines.
//
// # Files
//
// Everything lives in one directory:
//
//	LOCK                        flock(2)ed by the open Dir; never moved
//	checkpoint                  the last checkpoint
//	checkpoint.tmp              a checkpoint being written (renamed over checkpoint)
//	journal-%020d.log           journal files, named by the first seq they hold
//	INVALID                     the journal failed; the next start must Reset
//	broken-<unix-ms>/           state moved aside by Reset (the newest 3 are kept)
//
// Creating, renaming and removing a file is followed by an fsync of the
// directory.
//
// # Journal format (the on-disk contract; integers little-endian)
//
// A journal file starts with a 28-byte header, fsynced (with the directory)
// when the file is created, before any record:
//
//	magic    [8]byte  "CRSJRNL1"
//	version  u32      1
//	epoch    [16]byte the publisher epoch of every record in the file
//
// then records, each written with one write(2):
//
//	len      u32  bytes after this 8-byte prefix: 40 + len(payload)
//	crc      u32  CRC-32C (Castagnoli) of those len bytes
//	seq      u64  the batch's sequence number
//	epoch    u64  master epoch  } the batch's master Position
//	rev      u64  master revision }
//	eventID  u64  Record.LastEventID
//	unixMS   i64  Record.UnixMilli
//	payload  [len-40]byte the msgpack payload as published
//
// Decoders reject len < 40 and payloads over MaxPayload (64 MiB) before
// reading them. Sequence numbers increase strictly across records and files
// (gaps are burned numbers); a file's name is its first record's seq. A new
// file is started by each OpenJournal (at its first Append) and when the
// current one would exceed Options.MaxFileBytes; the file it leaves is
// fsynced first, so only the newest file can have lost a tail to a machine
// crash. A record that is short, has a bad length or a bad CRC and is the
// last thing in the newest file (or is followed only by zero bytes) is a
// torn write: it is truncated away with a warning. Anything else that fails
// a check (magic, version, epoch, order, name, a bad record in an older
// file or followed by data) is ErrCorrupt.
//
// # Checkpoint format (the on-disk contract; integers little-endian)
//
//	magic        [8]byte  "CRSCKPT1"
//	version      u32      1
//	epoch        [16]byte Header.PublisherEpoch
//	seq          u64      Header.Seq
//	masterEpoch  u64      Header.Master.Epoch
//	masterRev    u64      Header.Master.Revision
//	lastEventID  u64      Header.LastEventID
//	writtenMS    i64      Header.WrittenUnixMilli
//	subscribers  u64      Header.Subscribers
//	entries      u64      Header.Entries: the number of entries below
//	tenants      u64      the number of tenant runs below
//	tenants × run:
//	    uvarint len, tenant bytes   (≤ MaxTenantLen)
//	    uvarint count               (≥ 1)
//	    count × entry:
//	        medium   byte           1 = kvevent.MediumCPU, 2 = kvevent.MediumDisk
//	        uvarint len, key bytes  (≤ MaxKeyLen)
//	        uvarint len, group bytes (≤ MaxGroupLen)
//	trailer      u64      xxhash64 of every preceding byte
//
// Uvarints are canonical (minimal). A tenant may have more than one run
// (the writer splits long runs and the entries it is given may return to a
// tenant). The run counts sum to entries exactly and nothing follows the
// trailer. The file is written as checkpoint.tmp, fsynced, renamed over
// checkpoint, and the directory fsynced; a torn or altered file fails its
// checks and is never trusted.
package statedir
