"""dcp_memstore: an in-memory storage plugin for torch.distributed.checkpoint.

``MemoryStorageWriter`` writes each rank's shards to a node-local tmpfs (through the pinned tmpfs mapping for
GPU tensors), ``MemoryStorageReader`` reads them back zero-copy, and ``MemStore`` owns the store: layout,
commit protocol, retention, the newest-checkpoint query, the replication of each node's files to its peers
(jobs that span several nodes), and the background persister that flushes chosen checkpoints to object or file
storage in the standard DCP layout.
"""

import torch

from dcp_memstore.torch_support import require_supported_torch

require_supported_torch(torch.__version__)  # before the modules that use DCP are imported

from dcp_memstore.dcp.reader import MemoryStorageReader
from dcp_memstore.dcp.writer import MemoryStorageWriter
from dcp_memstore.errors import (
    CheckpointExistsError,
    CheckpointInUseError,
    ChecksumMismatchError,
    CommitError,
    CorruptShardError,
    InsufficientSpaceError,
    NodesUnansweredError,
    PersistError,
    StagingTimeoutError,
    TruncatedShardError,
)
from dcp_memstore.memstore import MemStore
from dcp_memstore.status import CheckpointStatus
from dcp_memstore.store.events import Event

__version__ = "0.1.0"

__all__ = [
    "MemStore",
    "MemoryStorageWriter",
    "MemoryStorageReader",
    "ChecksumMismatchError",
    "CorruptShardError",
    "TruncatedShardError",
    "CheckpointExistsError",
    "CheckpointInUseError",
    "CommitError",
    "InsufficientSpaceError",
    "NodesUnansweredError",
    "PersistError",
    "CheckpointStatus",
    "Event",
    "StagingTimeoutError",
    "__version__",
]
