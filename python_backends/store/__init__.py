"""The node-level embedding store and the references that travel instead of embeddings.

``reference``: the signed, versioned reference format. ``keys``: content keys.
``embedding_store``: the LMDB-backed store shared by every process of a node, built from
``config``, ``tables``, ``placement``, ``entries``, ``leases``, ``single_flight`` and ``verified``.
``DEFAULT_CAPACITY_BYTES`` is the one default of the store's capacity.
Plain Python: nothing here imports Triton.
"""

from python_backends.store.config import DEFAULT_CAPACITY_BYTES, DEFAULT_STORE_PATH, StoreConfig
from python_backends.store.embedding_store import EmbeddingStore
from python_backends.store.entries import StoreFullError
from python_backends.store.keys import KeyConfig, content_key, tenant_key
from python_backends.store.leases import ReapReport
from python_backends.store.payload import EntryMeta
from python_backends.store.reference import (
    MAX_REFERENCE_BYTES,
    Reference,
    parse_reference,
)
from python_backends.store.single_flight import Claim, ClaimKind

__all__ = [
    "DEFAULT_CAPACITY_BYTES",
    "DEFAULT_STORE_PATH",
    "MAX_REFERENCE_BYTES",
    "Claim",
    "ClaimKind",
    "EmbeddingStore",
    "EntryMeta",
    "KeyConfig",
    "ReapReport",
    "Reference",
    "StoreConfig",
    "StoreFullError",
    "content_key",
    "parse_reference",
    "tenant_key",
]
