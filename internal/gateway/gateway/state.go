package gateway

import (
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"

	"github.com/crescent-kv/crescent/internal/gateway/announced"
	"github.com/crescent-kv/crescent/internal/gateway/statedir"
	"github.com/crescent-kv/crescent/pkg/kvevent"
)

// State modes, as the status reports them.
const (
	stateOff      = "off"      // no --state-dir
	stateNew      = "new"      // first start in an empty state directory
	stateRestored = "restored" // continued from the state directory
	stateReset    = "reset"    // state lost or unreadable: a new publisher epoch
)

// persisted is what a gateway starts from: its publisher identity and
// position, the set it had published (one copy for the recorder, one for
// the source) and the batches its replay ring held.
type persisted struct {
	mode   string
	reason error // why the state was reset (mode reset)

	header         statedir.Header // epoch, last sequence, master position, last event id, subscribers
	pubSet, srcSet *announced.Set
	ring           []statedir.Record
	// subscribersKnown: the checkpoint was written after publishing began,
	// so header.Subscribers counts the subscribers of then. The checkpoint
	// a new epoch starts with is written before anyone could subscribe.
	subscribersKnown bool
}

// loadState reads the checkpoint and the journal after it (docs/
// gateway-state.md, "Restart"). State that fails any check is moved aside
// and replaced by a new publisher identity; loadState fails only when the
// directory cannot be used at all.
func loadState(d *statedir.Dir, ringRecords, ringBytes int, lg *slog.Logger) (persisted, error) {
	p, err := readState(d, ringRecords, ringBytes)
	switch {
	case err == nil && p.mode == stateRestored:
		lg.Info("gateway state restored: the sequence continues", "dir", d.Path(),
			"publisher_epoch", p.header.PublisherEpoch.String(), "last_sequence", p.header.Seq,
			"master_epoch", p.header.Master.Epoch, "master_revision", p.header.Master.Revision,
			"announced", p.pubSet.Len(), "ring_batches", len(p.ring))
		return p, nil
	case err == nil:
		// No checkpoint. Journal files without one cannot be trusted
		// (their epoch is unknown): set them aside.
		if js, _ := filepath.Glob(filepath.Join(d.Path(), "journal-*.log")); len(js) > 0 {
			err = errors.New("journal files without a checkpoint")
		}
	}
	mode := stateNew
	if err != nil {
		mode = stateReset
		lg.Error("gateway state unusable; starting a new publisher epoch (subscribers will see a new epoch or a sequence reset and rebuild)",
			"dir", d.Path(), "err", err)
		if rerr := d.Reset(err); rerr != nil {
			return persisted{}, fmt.Errorf("state dir %s: %w (and setting it aside failed: %v)", d.Path(), err, rerr)
		}
	}
	fresh := persisted{mode: mode, reason: err, header: statedir.Header{PublisherEpoch: statedir.NewEpoch()},
		pubSet: announced.New(), srcSet: announced.New()}
	// The identity is durable before anything is published under it.
	if err := d.WriteCheckpoint(fresh.header, nil); err != nil {
		return persisted{}, fmt.Errorf("state dir %s: %w", d.Path(), err)
	}
	lg.Info("gateway state: new publisher epoch", "dir", d.Path(), "publisher_epoch", fresh.header.PublisherEpoch.String(), "state", mode)
	return fresh, nil
}

// readState loads the checkpoint and replays the journal; mode is
// stateRestored when a checkpoint was found, "" when there was none.
func readState(d *statedir.Dir, ringRecords, ringBytes int) (persisted, error) {
	set := announced.New()
	h, found, err := d.LoadCheckpoint(func(ev kvevent.Event) error {
		set.Store(ev.Tenant, ev.Key, ev.Medium, ev.GroupID)
		return nil
	})
	if err != nil || !found {
		return persisted{}, err
	}
	p := persisted{subscribersKnown: h.Seq > 0}
	dec := kvevent.Decoder{AllowEmpty: true}
	err = d.Replay(h.PublisherEpoch, h.Seq, func(r statedir.Record) error {
		b, err := dec.DecodePayload(r.Seq, r.Payload)
		if err != nil {
			return fmt.Errorf("%w: journal record %d: %v", statedir.ErrCorrupt, r.Seq, err)
		}
		for _, ev := range b.Events {
			switch ev.Type {
			case kvevent.Stored:
				set.Store(ev.Tenant, ev.Key, ev.Medium, ev.GroupID)
			case kvevent.Removed:
				set.Remove(ev.Tenant, ev.Key, ev.Medium)
			case kvevent.Cleared:
				set.Clear(ev.Tenant)
			}
		}
		h.Seq, h.LastEventID = r.Seq, r.LastEventID
		if r.Master != (statedir.Position{}) {
			h.Master = r.Master
		}
		return nil
	})
	if err != nil {
		return persisted{}, err
	}
	ring, err := d.Tail(h.PublisherEpoch, ringRecords, ringBytes)
	if err != nil {
		return persisted{}, err
	}
	// The recorder and the source each own a copy.
	p.mode, p.header, p.ring, p.pubSet, p.srcSet = stateRestored, h, ring, set, set.Clone()
	return p, nil
}
