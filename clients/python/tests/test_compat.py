"""A connector-style script written from Mooncake's API reference
(docs/source/python-api-reference/mooncake-store.md: register_buffer,
batch_put_from, batch_is_exist, batch_get_into, batch_remove,
unregister_buffer), run unchanged except for the import and `setup`.

It moves 1,000 KV blocks of 64 KiB through two registered numpy buffers,
the way LMCache's and vLLM's Mooncake connectors offload and load blocks.
"""

from __future__ import annotations

import numpy as np

BLOCKS = 1000
BLOCK = 64 * 1024


def connector_roundtrip(store, rank: int = 0) -> None:
    # ---- from here on, only Mooncake's documented API --------------------
    src = np.random.default_rng(rank).integers(0, 256, BLOCKS * BLOCK, dtype=np.uint8)
    dst = np.zeros(BLOCKS * BLOCK, dtype=np.uint8)
    src_ptr, dst_ptr = src.ctypes.data, dst.ctypes.data
    assert store.register_buffer(src_ptr, src.nbytes) == 0
    assert store.register_buffer(dst_ptr, dst.nbytes) == 0

    keys = [f"kv_{rank}_{i}" for i in range(BLOCKS)]
    src_ptrs = [src_ptr + i * BLOCK for i in range(BLOCKS)]
    dst_ptrs = [dst_ptr + i * BLOCK for i in range(BLOCKS)]
    sizes = [BLOCK] * BLOCKS

    # Offload: store every block that is not there yet.
    exists = store.batch_is_exist(keys)
    todo = [i for i, e in enumerate(exists) if e != 1]
    assert len(todo) == BLOCKS
    results = store.batch_put_from([keys[i] for i in todo], [src_ptrs[i] for i in todo], [sizes[i] for i in todo])
    assert results == [0] * BLOCKS, (sorted(set(results)), getattr(store, "last_error", None))
    assert store.batch_is_exist(keys) == [1] * BLOCKS
    assert store.is_exist(keys[0]) == 1
    assert store.get_size(keys[-1]) == BLOCK

    # Load: read every block back into the second buffer.
    got = store.batch_get_into(keys, dst_ptrs, sizes)
    assert got == [BLOCK] * BLOCKS, (sorted(set(got)), getattr(store, "last_error", None))
    assert np.array_equal(src, dst)

    # A block that was never stored reads as a negative code.
    assert store.get_into(f"kv_{rank}_missing", dst_ptr, BLOCK) < 0

    # Drop the blocks (force: the reads above hold leases, as in Mooncake).
    rm = store.batch_remove(keys, force=True)
    assert rm == [0] * BLOCKS, (sorted(set(rm)), getattr(store, "last_error", None))
    assert store.batch_is_exist(keys) == [0] * BLOCKS
    assert store.remove(keys[0]) < 0
    assert store.unregister_buffer(src_ptr) == 0
    assert store.unregister_buffer(dst_ptr) == 0
    # ---- end of Mooncake's API ---------------------------------------------


def test_connector_script(cluster, tenant):
    from crescent import MooncakeDistributedStore  # instead of: from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    # Mooncake: store.setup("localhost", "http://localhost:8080/metadata", 512<<20, 128<<20, "tcp", "", "localhost:50051")
    assert store.setup(cluster.master, tenant) == 0
    connector_roundtrip(store)
    assert store.close() == 0
