package statedir

import (
	"cmp"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Defaults of Options.
const (
	// DefaultSyncInterval is the gateway's --state-sync-interval default.
	// (Options.SyncInterval 0 means "fsync every Append", not this.)
	DefaultSyncInterval = time.Second
	DefaultMaxFileBytes = 64 << 20
	DefaultKeepSeqs     = 10000
)

// ErrLocked reports a state directory already opened by another Dir (in this
// process or another).
var ErrLocked = errors.New("statedir: state directory is in use")

// ErrClosed reports use of a closed Dir or Journal.
var ErrClosed = errors.New("statedir: closed")

// ErrInvalidated is WriteCheckpoint's answer once the journal has failed:
// the next start resets the state, and a checkpoint written meanwhile
// could undo the mark (invalidate).
var ErrInvalidated = errors.New("statedir: the journal failed; no checkpoint until the next start resets the state")

// Options tune a Dir. The zero value fsyncs every Append and uses the default
// file size and ring reserve; DefaultOptions is the gateway's default.
type Options struct {
	// SyncInterval: fsync the journal at most this often (checked in
	// Append; Journal.Sync forces one). 0 fsyncs every Append.
	SyncInterval time.Duration
	// MaxFileBytes: start a new journal file when the current one would
	// grow past this (0: DefaultMaxFileBytes). A record larger than it gets
	// a file of its own.
	MaxFileBytes int64
	// KeepSeqs: compaction keeps journal records with seq >
	// checkpoint seq - KeepSeqs, for the replay ring (0: DefaultKeepSeqs).
	KeepSeqs uint64
}

// DefaultOptions is what the gateway's flags default to.
func DefaultOptions() Options {
	return Options{SyncInterval: DefaultSyncInterval, MaxFileBytes: DefaultMaxFileBytes, KeepSeqs: DefaultKeepSeqs}
}

func (o Options) withDefaults() (Options, error) {
	if o.SyncInterval < 0 {
		return o, fmt.Errorf("statedir: SyncInterval must not be negative, got %v", o.SyncInterval)
	}
	if o.MaxFileBytes < 0 {
		return o, fmt.Errorf("statedir: MaxFileBytes must not be negative, got %d", o.MaxFileBytes)
	}
	if o.MaxFileBytes == 0 {
		o.MaxFileBytes = DefaultMaxFileBytes
	}
	if o.KeepSeqs == 0 {
		o.KeepSeqs = DefaultKeepSeqs
	}
	return o, nil
}

// File names in the directory.
const (
	lockName       = "LOCK"
	checkpointName = "checkpoint"
	checkpointTmp  = "checkpoint.tmp"
	invalidName    = "INVALID"
	journalPrefix  = "journal-"
	journalSuffix  = ".log"
	brokenPrefix   = "broken-"
	keepBroken     = 3
)

// Dir is an opened state directory. Its methods are safe for concurrent use
// (they are serialised); see the package documentation for the order they
// are meant to be called in.
type Dir struct {
	path string
	opts Options
	lg   *slog.Logger

	// mu guards the fields below and serialises the Dir's operations.
	// Lock order: mu before Journal.mu.
	mu      sync.Mutex
	lock    *os.File // flock(2)ed dir/LOCK; nil once closed
	journal *Journal // the open journal, or nil
	// verified is the result of the last successful scan of the journal
	// (Replay, Tail, OpenJournal) or of the last journal closed; nil when
	// unknown (Reset clears it).
	verified *scanState
	// invalidated is set once the journal failed (markInvalid).
	invalidated atomic.Bool
}

type scanState struct {
	epoch   Epoch
	lastSeq uint64
}

// Open opens (creating it with mode 0o750 if needed) the state directory
// dir and takes an exclusive lock on dir/LOCK. A directory already opened by
// another Dir — in another process or this one — fails with ErrLocked. A nil
// lg discards logs.
func Open(dir string, opts Options, lg *slog.Logger) (*Dir, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	if lg == nil {
		lg = slog.New(slog.DiscardHandler)
	}
	dir = filepath.Clean(dir)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return nil, fmt.Errorf("statedir: %w", err)
	}
	lf, err := os.OpenFile(filepath.Join(dir, lockName), os.O_RDWR|os.O_CREATE, 0o640)
	if err != nil {
		return nil, fmt.Errorf("statedir: %w", err)
	}
	// flock locks belong to the open file description, so a second Open in
	// this process conflicts just like another process's.
	if err := syscall.Flock(int(lf.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		lf.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: %s is locked by another gateway (or another statedir.Dir in this process)", ErrLocked, dir)
		}
		return nil, fmt.Errorf("statedir: lock %s: %w", dir, err)
	}
	d := &Dir{path: dir, opts: opts, lg: lg.With("state_dir", dir), lock: lf}
	// A checkpoint.tmp is what a crash in WriteCheckpoint left behind.
	if err := os.Remove(d.file(checkpointTmp)); err == nil {
		_ = syncDir(dir)
	}
	return d, nil
}

// Path is the directory.
func (d *Dir) Path() string { return d.path }

func (d *Dir) file(name string) string { return filepath.Join(d.path, name) }

// Close closes the open journal (fsyncing it) and releases the lock.
// Closing a closed Dir does nothing.
func (d *Dir) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.lock == nil {
		return nil
	}
	var err error
	if j := d.journal; j != nil {
		d.journal = nil
		_, _, err = j.close()
	}
	if cerr := d.lock.Close(); err == nil {
		err = cerr
	}
	d.lock = nil
	return err
}

// checkOpenLocked returns ErrClosed once the Dir is closed.
func (d *Dir) checkOpenLocked() error {
	if d.lock == nil {
		return ErrClosed
	}
	return nil
}

// checkValid reports the INVALID marker as ErrCorrupt.
func (d *Dir) checkValid() error {
	_, err := os.Lstat(d.file(invalidName))
	switch {
	case err == nil:
		return fmt.Errorf("%w: %s exists: the journal failed in an earlier run", ErrCorrupt, invalidName)
	case errors.Is(err, os.ErrNotExist):
		return nil
	default:
		return fmt.Errorf("statedir: %w", err)
	}
}

// markInvalid makes sure the next start resets: it creates dir/INVALID,
// and where that fails (a full filesystem may have no inode or block left
// for it) it spoils the state files in place instead. Either way no
// checkpoint is written any more (ErrInvalidated): a fresh one would undo
// the spoiling, and restore, after a crash, state older than what was
// published under the same epoch.
func (d *Dir) markInvalid(cause error) {
	d.invalidated.Store(true)
	f, err := createInvalid(d.file(invalidName))
	if err == nil {
		_, err = f.WriteString(cause.Error() + "\n")
		if serr := f.Sync(); err == nil {
			err = serr
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err == nil {
		err = syncDir(d.path)
	}
	if err == nil {
		return
	}
	if serr := d.spoil(); serr != nil {
		d.lg.Error("cannot mark state invalid: after a crash the next start may restore state older than what was published",
			"err", err, "spoil_err", serr, "cause", cause)
		return
	}
	d.lg.Error("cannot create INVALID; spoiled the state files' headers in place instead, so the next start resets",
		"err", err, "cause", cause)
}

// createInvalid creates the INVALID marker; a test makes it fail as a
// filesystem out of inodes does.
var createInvalid = func(path string) (*os.File, error) {
	return os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o640)
}

// spoilMark overwrites a state file's magic: it then fails its checks.
const spoilMark = "INVALID!"

// spoil overwrites the magic of the checkpoint and of every journal file
// in place and syncs them. It needs no new inode or block, so it works on
// a full filesystem; the next start finds them corrupt and resets.
func (d *Dir) spoil() error {
	names := []string{checkpointName}
	ents, err := os.ReadDir(d.path)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if n := e.Name(); strings.HasPrefix(n, journalPrefix) && strings.HasSuffix(n, journalSuffix) {
			names = append(names, n)
		}
	}
	var errs []error
	for _, n := range names {
		f, err := os.OpenFile(d.file(n), os.O_WRONLY, 0)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if st, err := f.Stat(); err == nil && st.Size() >= int64(len(spoilMark)) {
			_, err = f.WriteAt([]byte(spoilMark), 0)
			if err == nil {
				err = f.Sync()
			}
			errs = append(errs, err)
		}
		errs = append(errs, f.Close())
	}
	return errors.Join(errs...)
}

// Reset moves every state file (checkpoint, checkpoint.tmp, journal files,
// INVALID) into dir/broken-<unix-ms>/ and logs reason; the gateway then
// starts a new publisher epoch. Only the newest three broken-* directories
// are kept. Reset refuses while a journal is open.
func (d *Dir) Reset(reason error) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.checkOpenLocked(); err != nil {
		return err
	}
	if d.journal != nil {
		return errors.New("statedir: Reset with an open journal")
	}
	d.verified = nil
	d.invalidated.Store(false) // a new state begins
	ents, err := os.ReadDir(d.path)
	if err != nil {
		return fmt.Errorf("statedir: %w", err)
	}
	var move []string
	for _, e := range ents {
		n := e.Name()
		if n == checkpointName || n == checkpointTmp || n == invalidName ||
			strings.HasPrefix(n, journalPrefix) && strings.HasSuffix(n, journalSuffix) {
			move = append(move, n)
		}
	}
	if len(move) == 0 {
		d.lg.Warn("state reset; there were no state files", "reason", reason)
		return nil
	}
	ms := time.Now().UnixMilli()
	var broken string
	for {
		broken = d.file(brokenPrefix + strconv.FormatInt(ms, 10))
		err := os.Mkdir(broken, 0o750)
		if err == nil {
			break
		}
		if !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("statedir: %w", err)
		}
		ms++
	}
	for _, n := range move {
		if err := os.Rename(d.file(n), filepath.Join(broken, n)); err != nil {
			return fmt.Errorf("statedir: reset: %w", err)
		}
	}
	if err := syncDir(broken); err != nil {
		return fmt.Errorf("statedir: %w", err)
	}
	if err := syncDir(d.path); err != nil {
		return fmt.Errorf("statedir: %w", err)
	}
	d.lg.Warn("state reset: state files moved aside", "reason", reason, "moved_to", broken, "files", len(move))
	d.pruneBroken()
	return nil
}

// pruneBroken deletes all but the newest keepBroken broken-* directories.
func (d *Dir) pruneBroken() {
	ents, err := os.ReadDir(d.path)
	if err != nil {
		d.lg.Warn("cannot list state directory", "err", err)
		return
	}
	type broken struct {
		name string
		ms   int64
	}
	var bs []broken
	for _, e := range ents {
		ms, err := strconv.ParseInt(strings.TrimPrefix(e.Name(), brokenPrefix), 10, 64)
		if e.IsDir() && strings.HasPrefix(e.Name(), brokenPrefix) && err == nil {
			bs = append(bs, broken{e.Name(), ms})
		}
	}
	if len(bs) <= keepBroken {
		return
	}
	slices.SortFunc(bs, func(a, b broken) int { return cmp.Compare(a.ms, b.ms) })
	for _, b := range bs[:len(bs)-keepBroken] {
		if err := os.RemoveAll(d.file(b.name)); err != nil {
			d.lg.Warn("cannot delete old broken state", "dir", b.name, "err", err)
		}
	}
	_ = syncDir(d.path)
}

// syncDir fsyncs a directory, making its entries' creation, renaming and
// removal durable.
func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = f.Sync()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// NewEpoch returns a random publisher epoch (crypto/rand).
func NewEpoch() Epoch {
	var e Epoch
	_, _ = rand.Read(e[:]) // never fails (Go ≥ 1.24 crashes instead)
	return e
}

// String is the epoch in hex.
func (e Epoch) String() string { return hex.EncodeToString(e[:]) }
