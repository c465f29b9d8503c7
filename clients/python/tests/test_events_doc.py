"""The minimal example of clients/python/EVENTS.md runs as written (its
endpoints pointed at a scripted publisher) and answers what it says."""

import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))  # the _events_* helpers, whatever the import mode

from _events_fake import FakeGateway, batch  # noqa: E402
from _events_vectors import mp_map, payload, valid_kvs  # noqa: E402

DOC = os.path.join(os.path.dirname(__file__), "..", "EVENTS.md")


def test_minimal_example_runs():
    with open(DOC) as f:
        code = re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)
    fake = FakeGateway()
    try:
        chunk = payload(mp_map(valid_kvs("stored", False, 0, key="blk/0")),
                        mp_map(valid_kvs("stored", False, 0, key="blk/1", medium="disk")))
        fake.snapshot = (4, b"E" * 16, [chunk])
        for name, ep in (("GATEWAY", fake.pub_ep), ("REPLAY", fake.replay_ep), ("SNAPSHOT", fake.snap_ep)):
            code, n = re.subn(r'^%s = "[^"]*"' % name, '%s = "%s"' % (name, ep), code, flags=re.M)
            assert n == 1, name
        ns = {}
        exec(compile(code, DOC, "exec"), ns)
        sub = ns["sub"]
        try:
            assert sub.stats().synced
            assert ns["cached_prefix"]("t", ["blk/0", "blk/1", "blk/2"]) == 2
            assert ns["fastest_medium"]("t", "blk/1") == "disk" and ns["fastest_medium"]("t", "blk/9") is None
            fake.wait_subscribed()
            fake.publish(5, batch(50, ("stored", "blk/2")))
            assert sub.wait(lambda s: ns["cached_prefix"]("t", ["blk/0", "blk/1", "blk/2"]) == 3, 5)
        finally:
            sub.close()
    finally:
        fake.close()
