"""The job's key-value store: an HMAC-authenticated framed TCP server (rendezvous, unique ids,
cross-rank checks) and its client."""

from nccl_ddp.store.client import DEFAULT_TIMEOUT, PrefixStore, TCPStore, connect_store
from nccl_ddp.store.server import StoreServer
from nccl_ddp.store.wire import MAX_FRAME

__all__ = ["DEFAULT_TIMEOUT", "MAX_FRAME", "PrefixStore", "StoreServer", "TCPStore", "connect_store"]
