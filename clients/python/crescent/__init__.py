"""Crescent's Python client.

    from crescent import DistributedStore, ReplicateConfig
    store = DistributedStore()
    store.setup("127.0.0.1:50051")           # Crescent's master(s)
    store.put("k", b"v"); store.get("k")

crescent.store.DistributedStore is Mooncake's MooncakeDistributedStore API
(integer codes); crescent.client.Client is the same operations raising
crescent.errors.CrescentError. `from crescent import events` is the
KV-event subscriber (imported on demand only). See clients/python/README.md.
"""

from .client import Client, ReplicateConfig
from .errors import CrescentError, ErrorCode
from .store import DistributedStore, MooncakeDistributedStore

__all__ = ["Client", "ReplicateConfig", "CrescentError", "ErrorCode", "DistributedStore", "MooncakeDistributedStore"]
