"""The client's own decoder of network bytes (google.rpc.Status details in
crescent.errors), fuzzed: mutations of a real NOT_LEADER status and random
bytes never raise anything but ValueError and never decode past the input."""

from __future__ import annotations

import random

import pytest

from crescent import errors
from test_failures import _not_leader


def test_decodes_not_leader():
    assert errors._error_info(_not_leader("10.0.0.1:50051")) == ("NOT_LEADER", {"leader": "10.0.0.1:50051"})
    assert errors._error_info(b"") == ("", {})


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_status_details(seed):
    rng = random.Random(seed)
    valid = _not_leader("127.0.0.1:1")
    for _ in range(5000):
        b = bytearray(valid)
        for _ in range(rng.randint(1, 6)):
            op = rng.randrange(4)
            if op == 0 and b:
                b[rng.randrange(len(b))] = rng.randrange(256)
            elif op == 1 and b:
                del b[rng.randrange(len(b)) :]
            elif op == 2:
                b[rng.randrange(len(b) + 1) : 0] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 12)))
            else:
                b = bytearray(rng.randbytes(rng.randint(0, 64)))
        try:
            reason, md = errors._error_info(bytes(b))
        except ValueError:
            continue
        assert isinstance(reason, str) and isinstance(md, dict)
        assert len(reason) <= len(b)
