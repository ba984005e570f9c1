"""Megatron-Core ``dist_checkpointing`` strategies that keep checkpoints in a ``MemStore`` (tmpfs).

``MemStoreSaveStrategy(store)`` is a ``sharded_strategy`` for ``dist_checkpointing.save`` (synchronous, or
``async_sharded_save=True`` returning Megatron's ``AsyncRequest``) and ``MemStoreLoadStrategy(store)`` one
for ``dist_checkpointing.load``. Megatron's ``checkpoint_dir`` keeps its own small files (``common.pt``,
``metadata.json``) plus ``dcp_memstore.json``; the tensors and ShardedObjects go to the store under the
directory's base name. Needs megatron-core 0.16.1 (the ``megatron`` extra); see docs/megatron.md.
"""

try:
    import megatron.core.dist_checkpointing  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"dcp_memstore.megatron needs megatron-core ({e}); install it with pip install megatron-core==0.16.1"
    ) from e

from megatron.core.dist_checkpointing.strategies.base import StrategyAction, register_default_strategy

from dcp_memstore.megatron.checkpoint_dir import BACKEND, POINTER, VERSION, checkpoint_id_for
from dcp_memstore.megatron.load import MemStoreLoadStrategy, StoreNeededLoadStrategy
from dcp_memstore.megatron.save import MemStoreSaveStrategy

# Megatron looks up a default load strategy by the backend in metadata.json, also to read only the common
# state (load_common_state_dict); without one registered it cannot even do that.
register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, StoreNeededLoadStrategy())

__all__ = [
    "BACKEND",
    "POINTER",
    "VERSION",
    "MemStoreLoadStrategy",
    "MemStoreSaveStrategy",
    "StoreNeededLoadStrategy",
    "checkpoint_id_for",
]
