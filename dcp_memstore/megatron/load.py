"""``MemStoreLoadStrategy``: Megatron-Core's sharded load strategy, reading from a ``MemStore``.

It converts Megatron's sharded state dict with Megatron's own torch_dist conversions, loads it with
``dcp.load`` and dcp_memstore's ``MemoryStorageReader`` (checksums verified, DCP resharding, the persisted
copy as fallback when the store has one), and converts the result back, as Megatron's torch_dist
strategy does with files. Also the default load strategy Megatron finds for backend ``"dcp_memstore"``:
a placeholder that lets Megatron read a checkpoint's common state and says how to load its tensors.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from megatron.core.dist_checkpointing.strategies.base import LoadShardedStrategy
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    TorchDistLoadShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from dcp_memstore.dcp.reader import MemoryStorageReader
from dcp_memstore.megatron.checkpoint_dir import (
    BACKEND,
    VERSION,
    CommonStateCheck,
    check_saved_into,
    read_pointer,
    resolve_checkpoint_id,
)
from dcp_memstore.memstore import MemStore


class MemStoreLoadStrategy(TorchDistLoadShardedStrategy):
    """Megatron ``sharded_strategy`` for ``dist_checkpointing.load`` of checkpoints saved with
    ``MemStoreSaveStrategy``: the tensors and ShardedObjects come from ``store``, Megatron's common state
    from ``checkpoint_dir`` as usual. ``loads`` counts the loads this object ran."""

    def __init__(self, store: MemStore) -> None:
        if not isinstance(store, MemStore):
            raise TypeError(f"MemStoreLoadStrategy needs a MemStore, got {type(store).__name__}")
        super().__init__()
        self.store = store
        self.loads = 0
        self._check_common_state = CommonStateCheck()

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(
                f"this checkpoint was saved with sharded backend {loaded_backend!r}, not {BACKEND!r}: its "
                "tensors are files in checkpoint_dir; "
                "load it without MemStoreLoadStrategy (Megatron's default)"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise CheckpointingException(
                f"{BACKEND} checkpoint format version {loaded_version} is not supported (this is {VERSION})"
            )

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike) -> StateDict:
        """Load the ShardedTensors and ShardedObjects of ``sharded_state_dict`` from the store."""
        cid = resolve_checkpoint_id(checkpoint_dir, self.store)
        self._check_common_state(checkpoint_dir)  # Megatron has read it: it must be this checkpoint's
        checked, mismatch_ok = [], {}
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedTensor):
                if sh.allow_shape_mismatch:
                    mismatch_ok[sh.key] = sh
                else:
                    checked.append(sh)
        flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        pyt_state_dict = mcore_to_pyt_state_dict(flat, True)
        planner = MCoreLoadPlanner(
            shapes_validation_sharded_tensors=checked, allow_shape_mismatch_sharded_tensors=mismatch_ok
        )
        dcp.load(
            pyt_state_dict,
            checkpoint_id=cid,
            storage_reader=_DirectoryReader(self.store, checkpoint_dir),
            planner=planner,
        )
        loaded = {key: _unwrap_pyt_sharded_tensor(value) for key, value in pyt_state_dict.items()}
        loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(loaded, sharded_state_dict)
        self.loads += 1
        return loaded

    def load_tensors_metadata(
        self, checkpoint_dir: str | os.PathLike, metadata: Metadata | None = None
    ) -> dict[str, Any]:
        """Global shape and dtype of every tensor in the checkpoint (as ShardedTensors without data).

        What Megatron's torch_dist strategy returns, made without its ``torch.empty(**properties.__dict__)``:
        DCP's tensor properties hold ``strides`` from torch 2.15 on, which ``torch.empty`` refuses, so
        Megatron-Core 0.16.1's own version fails there for every checkpoint."""
        if metadata is None:
            metadata = self._metadata(checkpoint_dir)
        return {
            key: ShardedTensor.from_rank_offsets(key, _meta_tensor(md)).without_data()
            for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }

    def load_sharded_metadata(self, checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
        """``load_tensors_metadata`` plus the checkpoint's ShardedObjects (without data)."""
        metadata = self._metadata(checkpoint_dir)
        objects = (
            ShardedObject.empty_from_unique_key(key)
            for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, BytesStorageMetadata)
        )
        return {
            **{sh.unique_key: sh for sh in objects},
            **self.load_tensors_metadata(checkpoint_dir, metadata),
        }

    def remove_sharded_tensors(self, checkpoint_dir: str | os.PathLike, key_prefix: str) -> None:
        raise NotImplementedError(
            "removing tensors from a dcp_memstore checkpoint is not supported; save a new checkpoint"
        )

    def _metadata(self, checkpoint_dir: str | os.PathLike) -> Metadata:
        reader = MemoryStorageReader(self.store)
        reader.reset(resolve_checkpoint_id(checkpoint_dir, self.store))
        metadata = reader.read_metadata()
        check_saved_into(checkpoint_dir, metadata)
        return metadata


class _DirectoryReader(MemoryStorageReader):
    """The reader of a load of ``checkpoint_dir``: it refuses, on every rank, a checkpoint other than the
    save that wrote the directory's pointer (``check_saved_into``)."""

    def __init__(self, store: MemStore, checkpoint_dir: str | os.PathLike) -> None:
        super().__init__(store)
        self.checkpoint_dir = checkpoint_dir

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        check_saved_into(self.checkpoint_dir, metadata)


def _meta_tensor(md: TensorStorageMetadata) -> torch.Tensor:
    """A tensor on the meta device with the global size and the properties DCP recorded of ``md``."""
    p = md.properties
    return torch.empty(
        md.size,
        dtype=p.dtype,
        layout=p.layout,
        requires_grad=p.requires_grad,
        memory_format=p.memory_format,
        pin_memory=p.pin_memory,
        device="meta",
    )


class StoreNeededLoadStrategy(LoadShardedStrategy):
    """Megatron's default load strategy for backend ``"dcp_memstore"`` (registered when
    ``dcp_memstore.megatron`` is imported). With it, code that only reads a checkpoint's common state
    (``dist_checkpointing.load_common_state_dict``) works as for any checkpoint; loading tensors says that
    they are in a store and which one, since only a ``MemStoreLoadStrategy`` given that store can read
    them."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True  # so that ShardedObjects reach load() too, rather than being looked for as files

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike) -> StateDict:
        raise CheckpointingException(_store_needed(checkpoint_dir))

    def load_tensors_metadata(self, checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
        raise CheckpointingException(_store_needed(checkpoint_dir))

    def load_sharded_metadata(self, checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
        """Read by ``dist_checkpointing.load`` with any ``strict`` but the default: the same hint as
        ``load``, rather than Megatron's bare NotImplementedError."""
        raise CheckpointingException(_store_needed(checkpoint_dir))

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        pass

    def check_version_compatibility(self, loaded_version: int) -> None:
        pass


def _store_needed(checkpoint_dir: str | os.PathLike) -> str:
    pointer = read_pointer(checkpoint_dir) or {}
    where = (
        f"root={pointer.get('root')!r}, job_id={pointer.get('job_id')!r}, checkpoint "
        f"{pointer.get('checkpoint_id')!r}"
        if pointer
        else f"the store it was saved to (no {checkpoint_dir}/dcp_memstore.json)"
    )
    return (
        f"the tensors of {checkpoint_dir} are in a dcp_memstore store ({where}); pass "
        "sharded_strategy=dcp_memstore.megatron.MemStoreLoadStrategy(MemStore(root=..., job_id=...)) "
        "to dist_checkpointing.load"
    )
