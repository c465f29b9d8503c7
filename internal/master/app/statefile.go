package app

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"

	masterv1 "github.com/crescent-kv/crescent/gen/crescent/master/v1"
	"github.com/crescent-kv/crescent/internal/master/ha"
	"github.com/crescent-kv/crescent/internal/master/meta"
	"github.com/crescent-kv/crescent/internal/rpcerr"
)

// A single master's unsettled segments (meta/unsettled.go), kept in a file
// under --state-dir: a restarted master rebuilds its objects from the
// agents' tables, which still list what a client removed while the agent
// was away, and would serve those objects again. With HA, etcd keeps them
// (ha/unsettled.go) and the file is not used.
const (
	unsettledFile = "unsettled.json"
	// maxUnsettledRecords is etcd's bound, and maxUnsettledFileBytes holds
	// that many records of the longest ids.
	maxUnsettledRecords   = ha.DefaultMaxUnsettled
	maxUnsettledFileBytes = 64 << 20
	maxUnsettledID        = 256
)

type unsettledDoc struct {
	Version  int            `json:"version"`
	Segments []unsettledRec `json:"segments"`
}

type unsettledRec struct {
	ID     string `json:"id"`
	Agent  string `json:"agent"`
	Memory bool   `json:"memory"`
}

// fileLedger is a meta.Ledger on a file, rewritten whole (a temporary file
// synced, then renamed) on every change; changes are rare (a segment's
// first removal left undone, and its settling).
type fileLedger struct {
	path string
	mu   sync.Mutex
	recs map[string]meta.UnsettledSegment
}

// openFileLedger reads dir's records (none when the file does not exist)
// and returns the ledger that keeps them from now on.
func openFileLedger(dir string) (*fileLedger, []meta.UnsettledSegment, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, nil, fmt.Errorf("state-dir: %w", err)
	}
	l := &fileLedger{path: filepath.Join(dir, unsettledFile), recs: map[string]meta.UnsettledSegment{}}
	f, err := os.Open(l.path)
	if errors.Is(err, fs.ErrNotExist) {
		return l, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("state-dir: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxUnsettledFileBytes+1))
	if err != nil {
		return nil, nil, fmt.Errorf("state-dir: read %s: %w", l.path, err)
	}
	segs, err := decodeUnsettled(b)
	if err != nil {
		return nil, nil, fmt.Errorf("state-dir: %s: %w (move it away to start without it: removals the master before did not carry out at agents may then be served again)", l.path, err)
	}
	for _, s := range segs {
		l.recs[s.ID] = s
	}
	return l, segs, nil
}

// decodeUnsettled parses the file's bytes, within its bounds.
func decodeUnsettled(b []byte) ([]meta.UnsettledSegment, error) {
	if len(b) > maxUnsettledFileBytes {
		return nil, fmt.Errorf("larger than %d bytes", maxUnsettledFileBytes)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var d unsettledDoc
	if err := dec.Decode(&d); err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, errors.New("data after the document")
	}
	if d.Version != 1 {
		return nil, fmt.Errorf("version %d, want 1", d.Version)
	}
	if len(d.Segments) > maxUnsettledRecords {
		return nil, fmt.Errorf("%d segments, at most %d", len(d.Segments), maxUnsettledRecords)
	}
	out := make([]meta.UnsettledSegment, 0, len(d.Segments))
	for _, r := range d.Segments {
		if r.ID == "" || len(r.ID) > maxUnsettledID || len(r.Agent) > maxUnsettledID {
			return nil, fmt.Errorf("segment %.64q of agent %.64q: ids are 1 to %d bytes", r.ID, r.Agent, maxUnsettledID)
		}
		out = append(out, meta.UnsettledSegment{ID: r.ID, Agent: r.Agent, Memory: r.Memory})
	}
	return out, nil
}

func (l *fileLedger) Record(_ context.Context, segs []meta.UnsettledSegment) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, s := range segs {
		l.recs[s.ID] = s
	}
	return l.writeLocked()
}

func (l *fileLedger) Forget(_ context.Context, ids []string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, id := range ids {
		delete(l.recs, id)
	}
	return l.writeLocked()
}

// writeLocked replaces the file with the records. A failure leaves the old
// file (the records in memory stay ahead of it; the next write carries
// them) and answers the removal INTERNAL.
func (l *fileLedger) writeLocked() error {
	d := unsettledDoc{Version: 1, Segments: make([]unsettledRec, 0, len(l.recs))}
	for _, id := range slices.Sorted(maps.Keys(l.recs)) {
		s := l.recs[id]
		d.Segments = append(d.Segments, unsettledRec{ID: s.ID, Agent: s.Agent, Memory: s.Memory})
	}
	b, err := json.Marshal(d)
	if err != nil {
		return err
	}
	if err := writeFileSynced(l.path, b); err != nil {
		return rpcerr.Wrap(masterv1.ErrorReason_ERROR_REASON_INTERNAL, err,
			"the removal is done here but not recorded in --state-dir, and this master's restart could serve the object again: %v", err)
	}
	return nil
}

// writeFileSynced writes b to path through a synced temporary file, then
// syncs the directory: a crash leaves the old file or the new one.
func writeFileSynced(path string, b []byte) error {
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return err
	}
	dir, err := os.Open(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer dir.Close()
	return dir.Sync()
}
