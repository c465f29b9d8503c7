package publisher

import (
	"errors"
	"log/slog"
	"net"
	"time"
)

// acceptEach hands every connection l accepts to admit until l is closed.
// A failed Accept (out of file descriptors, say) is logged and retried after
// a pause doubling from 5 ms to 1 s, as net/http does, instead of spinning a
// core; closing l ends the loop within that pause.
func acceptEach(l net.Listener, lg *slog.Logger, what string, admit func(net.Conn)) {
	var delay time.Duration
	for {
		nc, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			lg.Warn(what+" accept failed; retrying", "err", err, "delay", delay)
			time.Sleep(delay)
			continue
		}
		delay = 0
		admit(nc)
	}
}
