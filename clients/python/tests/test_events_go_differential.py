"""Differential test: crescent.events' strict decoder against the Go decoder
itself. A PUB socket in this process publishes decode_test.go's vectors and
a few thousand seeded mutations of valid payloads to a real
``bin/crescentctl watch`` (pkg/kvevent's Subscriber and Decoder); every
message Go prints an event for is one it accepted. The Python decoder must
accept exactly the same messages.
"""

import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))  # the _events_* helpers, whatever the import mode

from crescent import events  # noqa: E402
from _events_vectors import (  # noqa: E402
    accept_vectors, mp_map, mutations, payload, reject_vectors, structured, valid_kvs,
)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
CTL = os.path.join(REPO, "bin", "crescentctl")


def _py_accepts(frames):
    try:
        events.decode_message(frames)
        return True
    except events.MalformedError:
        return False


def test_python_decoder_agrees_with_go():
    if not os.access(CTL, os.X_OK):
        pytest.skip("bin/crescentctl missing: run `make build`")
    # The corpus: 3-frame messages only (the Go subscriber drops a
    # connection over 8 frames, which is not a decoder verdict).
    payloads = []
    for _, frames, _ in accept_vectors():
        payloads.append(frames[2])
    for _, frames in reject_vectors():
        if len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8:
            payloads.append(frames[2])
    payloads += mutations(seed=19, n=2000)
    payloads += structured(seed=19, n=2000)

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    proc = subprocess.Popen([CTL, "watch", "--gateway", "tcp://127.0.0.1:%d" % port],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    lines = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(json.loads(line))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    probe = payload(mp_map(valid_kvs("stored", False, 1, key="probe")))
    try:
        # The SUB joins asynchronously: publish the probe until Go prints it.
        deadline = time.monotonic() + 15
        seen = False
        while not seen:
            assert time.monotonic() < deadline, "crescentctl watch never printed the probe"
            pub.send_multipart([b"", events.put_seq(1), probe])
            try:
                while True:
                    line = lines.get(timeout=0.1)
                    assert line is not None, "crescentctl watch exited"
                    seen = seen or line["seq"] == 1
            except queue.Empty:
                pass
        for i, p in enumerate(payloads):
            pub.send_multipart([b"", events.put_seq(i + 2), p])
        sentinel = len(payloads) + 2
        pub.send_multipart([b"", events.put_seq(sentinel), probe])
        go_accepts = set()
        while True:
            line = lines.get(timeout=30)
            assert line is not None, "crescentctl watch exited"
            if line["seq"] == sentinel:
                break
            go_accepts.add(line["seq"])
    finally:
        proc.terminate()
        proc.wait(10)
        pub.close()
        ctx.term()
    go_accepts.discard(1)
    differ = []
    for i, p in enumerate(payloads):
        s = i + 2
        py = _py_accepts([b"", events.put_seq(s), p])
        if py != (s in go_accepts):
            differ.append((s, "python accepts" if py else "go accepts", p.hex()))
    n_ok = len(go_accepts)
    print("corpus %d messages: Go accepted %d, rejected %d; differences %d"
          % (len(payloads), n_ok, len(payloads) - n_ok, len(differ)))
    assert not differ, differ[:5]
    # The corpus exercises both verdicts.
    assert 500 < n_ok < len(payloads) - 500
