package gateway

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"github.com/crescent-kv/crescent/internal/testutil"
)

// TestJournalSyncOutlivesAFailure: the journal's fsync failing (a full
// --state-dir) must not end syncJournal before its context, since the
// gateway stops every part when one returns. Before, a full state
// directory stopped the gateway within a second of the failure, with exit
// status 0 and "stopped" as the last line.
func TestJournalSyncOutlivesAFailure(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		calls := 0
		sync := func() error {
			calls++
			if calls >= 2 {
				return errors.New("write journal-1.log: no space left on device")
			}
			return nil
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			syncJournal(ctx, sync, time.Second, testutil.Logger())
		}()
		time.Sleep(time.Minute)
		synctest.Wait()
		select {
		case <-done:
			t.Fatal("syncJournal returned after a failed fsync, before its context ended: the gateway would stop")
		default:
		}
		if calls != 2 {
			t.Fatalf("fsync called %d times, want 2 (none after the failure)", calls)
		}
		cancel()
		<-done
	})
}
