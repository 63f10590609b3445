"""The node-level embedding store and the references that travel instead of embeddings.

``reference``: the signed, versioned reference format. ``keys``: content keys.
``embedding_store``: the LMDB-backed store shared by every process of a node.
Plain Python: nothing here imports Triton.
"""

from python_backends.store.embedding_store import (
    DEFAULT_STORE_PATH,
    Claim,
    ClaimKind,
    EmbeddingStore,
    EntryMeta,
    ReapReport,
    StoreConfig,
    StoreFullError,
)
from python_backends.store.keys import KeyConfig, content_key
from python_backends.store.reference import (
    MAX_REFERENCE_BYTES,
    Reference,
    parse_reference,
)

__all__ = [
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
]
