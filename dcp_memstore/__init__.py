"""dcp_memstore: an in-memory storage plugin for torch.distributed.checkpoint.

``MemoryStorageWriter`` writes each rank's shards to a node-local tmpfs (through the pinned tmpfs mapping
for GPU tensors), ``MemoryStorageReader`` reads them back zero-copy, and ``MemStore`` owns the store:
layout, commit protocol, retention and the newest-checkpoint query.
"""

from dcp_memstore.dcp.reader import MemoryStorageReader
from dcp_memstore.dcp.writer import MemoryStorageWriter
from dcp_memstore.errors import (
    CheckpointExistsError,
    ChecksumMismatchError,
    InsufficientSpaceError,
    StagingTimeoutError,
)
from dcp_memstore.memstore import MemStore

__version__ = "0.1.0"

__all__ = [
    "MemStore",
    "MemoryStorageWriter",
    "MemoryStorageReader",
    "ChecksumMismatchError",
    "CheckpointExistsError",
    "InsufficientSpaceError",
    "StagingTimeoutError",
    "__version__",
]
