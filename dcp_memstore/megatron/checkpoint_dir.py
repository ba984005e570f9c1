"""How a Megatron ``checkpoint_dir`` maps to a checkpoint in a ``MemStore``.

Megatron passes a directory to ``dist_checkpointing.save``/``load``; it writes its own small files there
(``common.pt``, ``metadata.json``) and inspects it. The tensors and ShardedObjects of a checkpoint saved
with ``MemStoreSaveStrategy`` are in the strategy's store instead, under a checkpoint id:

* **save:** the id is the directory's base name (``/ckpts/run1/iter_0000100`` -> ``iter_0000100``),
  validated like every store id (letters, digits, ``.``, ``_``, ``-``; no path). Just before the commit
  the coordinator writes ``dcp_memstore.json`` into the directory (format, backend, store root, job id,
  checkpoint id, the save's id in DCP's metadata, and the checksum of Megatron's ``common.pt`` as
  committed with the tensors) and
  Megatron's ``metadata.json``, so every checkpoint the store commits can be loaded through Megatron,
  also when the job dies before Megatron writes ``metadata.json`` itself.
* **load:** the id named by ``dcp_memstore.json`` (so a renamed directory still finds its checkpoint), else
  the base name; a pointer naming another job than the load strategy's store is refused, and so is a
  checkpoint under that id that another save wrote (the directory's was evicted and the id saved again
  from another directory, or the store is another root's), and a ``common.pt`` that changed since the
  commit (Megatron writes it before the strategy runs, so a later save into the same directory replaces
  it even when the store refuses that save).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megatron.core.dist_checkpointing.core import CheckpointingConfig, CheckpointingException, save_config
from torch.distributed.checkpoint.metadata import Metadata

from dcp_memstore.memstore import MemStore
from dcp_memstore.store.checksum import checksum_bytes
from dcp_memstore.store.ids import validate_name
from dcp_memstore.store.records import write_atomic

BACKEND = "dcp_memstore"  # metadata.json's sharded_backend of checkpoints saved with MemStoreSaveStrategy
VERSION = 1
POINTER = "dcp_memstore.json"  # in checkpoint_dir: which store and id hold the checkpoint's data
POINTER_FORMAT = 1
COMMON_STATE = "common.pt"  # Megatron's common state, which it writes into checkpoint_dir itself


def checkpoint_id_for(checkpoint_dir: str | os.PathLike) -> str:
    """The store checkpoint id a save into ``checkpoint_dir`` uses: its base name, validated.

    Raises ValueError saying why when the base name is not a valid id (or the path is a URL)."""
    path = os.fspath(checkpoint_dir)
    if "://" in str(path):
        raise ValueError(
            f"checkpoint_dir {path!r} is a URL; dcp_memstore's Megatron strategies need a local directory "
            "(Megatron's MultiStorageClient paths are not supported)"
        )
    name = os.path.basename(os.path.normpath(path))
    try:
        return validate_name(name)
    except ValueError as e:
        raise ValueError(
            f"checkpoint_dir {path!r}: its base name {name!r} is the checkpoint's id in the store and is "
            f"not valid ({e}). Name the directory like 'iter_0000100'."
        ) from None


def write_config(checkpoint_dir: str | os.PathLike) -> None:
    """Write Megatron's ``metadata.json`` for a checkpoint saved with ``MemStoreSaveStrategy``: the same
    config Megatron writes once the save's finalize step has returned."""
    save_config(CheckpointingConfig(BACKEND, VERSION), os.fspath(checkpoint_dir))


def write_pointer(
    checkpoint_dir: str | os.PathLike, store: MemStore, checkpoint_id: str, metadata: Metadata
) -> None:
    """Record in ``checkpoint_dir`` where its data is: the checkpoint that the store commits under
    ``checkpoint_id`` with DCP's ``metadata`` (atomically: a temporary file renamed into place)."""
    record = {
        "format": POINTER_FORMAT,
        "backend": BACKEND,
        "root": str(store.root),
        "job_id": store.job_id,
        "checkpoint_id": checkpoint_id,
        "save_id": _save_id(metadata),
        "common_checksum": common_checksum(checkpoint_dir),
    }
    write_atomic(Path(checkpoint_dir) / POINTER, (json.dumps(record, indent=1) + "\n").encode())


def common_version(checkpoint_dir: str | os.PathLike) -> tuple[int, ...] | None:
    """Which ``common.pt`` ``checkpoint_dir`` holds now: its inode, size and modification time, which a
    write changes and a chmod or a hard link does not; None if it has none or it cannot be looked at. A
    save takes it when it starts, after Megatron wrote the file, and its commit requires the same: a later
    save into the directory replaces the file before the store can refuse that save."""
    try:
        st = (Path(checkpoint_dir) / COMMON_STATE).stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def read_pointer(checkpoint_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The pointer record of ``checkpoint_dir``, or None if it has none."""
    path = Path(checkpoint_dir) / POINTER
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise CheckpointingException(f"{path} is not a valid dcp_memstore pointer: {e}") from e
    if not isinstance(record, dict) or record.get("format") != POINTER_FORMAT:
        raise CheckpointingException(f"{path} is not a dcp_memstore pointer of format {POINTER_FORMAT}")
    return record


def resolve_checkpoint_id(checkpoint_dir: str | os.PathLike, store: MemStore) -> str:
    """The store checkpoint id to load for ``checkpoint_dir``: the pointer's, else the base name.

    Raises CheckpointingException if the pointer says the checkpoint was saved to another job's store."""
    pointer = read_pointer(checkpoint_dir)
    if pointer is None:
        return checkpoint_id_for(checkpoint_dir)
    if pointer.get("job_id") != store.job_id:
        raise CheckpointingException(
            f"{checkpoint_dir} was saved to the store of job {pointer.get('job_id')!r} (root "
            f"{pointer.get('root')}), but this strategy's store is job {store.job_id!r} (root {store.root}); "
            f"use MemStore(root={pointer.get('root')!r}, job_id={pointer.get('job_id')!r})"
        )
    return validate_name(pointer.get("checkpoint_id"))


def check_saved_into(checkpoint_dir: str | os.PathLike, metadata: Metadata) -> None:
    """CheckpointingException unless ``metadata`` (DCP's, of the checkpoint that a load of ``checkpoint_dir``
    reads) is that of the save that wrote the directory's pointer. The store may hold another save under
    the id: the directory's checkpoint was evicted (``keep_in_memory``) or deleted and the id saved again
    from another directory, or the store is another root's, of a job with the same id. Pointers without a
    save id are not checked."""
    pointer = read_pointer(checkpoint_dir)
    expected = None if pointer is None else pointer.get("save_id")
    if expected is None or _save_id(metadata) == expected:
        return
    raise CheckpointingException(
        f"{checkpoint_dir} was saved as checkpoint {pointer.get('checkpoint_id')!r} of job "
        f"{pointer.get('job_id')!r} in store root {pointer.get('root')}, but the checkpoint under that id "
        "here is another save: this directory's was evicted (keep_in_memory) or deleted and the id saved "
        "again from another directory, or this store is another one. Load another checkpoint "
        "(store.latest_checkpoint())"
    )


def _save_id(metadata: Metadata) -> str | None:
    """The id DCP's planning gave a save (``StorageMeta.save_id``, made anew for every save)."""
    return None if metadata.storage_meta is None else metadata.storage_meta.save_id


def common_checksum(checkpoint_dir: str | os.PathLike) -> str | None:
    """The checksum (xxh3-64, hex) of ``checkpoint_dir``'s ``common.pt``; None if it has none."""
    try:
        data = (Path(checkpoint_dir) / COMMON_STATE).read_bytes()
    except FileNotFoundError:
        return None
    return f"{checksum_bytes(data):016x}"


class CommonStateCheck:
    """Called with a ``checkpoint_dir``: CheckpointingException unless its ``common.pt`` is the one
    committed with the checkpoint's tensors.

    Megatron writes ``common.pt`` before the sharded strategy runs, so a second save into the directory of
    a committed checkpoint replaces it even though the store refuses that save's tensors; loading would
    then mix the two saves. Pointers without a checksum (none recorded) are not checked.

    A check remembers the file it last verified (``common_version``, taken before reading it) with the
    checksum it matched: Megatron's ``FullyParallelLoadStrategyWrapper`` runs the load strategy twice per
    load (objects, then tensors), and the second run does not read and hash the same file again. A
    ``common.pt`` written since has another modification time, and is checked again."""

    def __init__(self) -> None:
        self._verified: tuple | None = None

    def __call__(self, checkpoint_dir: str | os.PathLike) -> None:
        pointer = read_pointer(checkpoint_dir)
        if pointer is None or pointer.get("common_checksum") is None:
            return
        path = Path(checkpoint_dir) / COMMON_STATE
        seen = (common_version(checkpoint_dir), pointer["common_checksum"])  # the version before it is read
        if seen[0] is not None and seen == self._verified:
            return
        if common_checksum(checkpoint_dir) != pointer["common_checksum"]:
            raise CheckpointingException(
                f"{path} changed after checkpoint {pointer.get('checkpoint_id')!r} was committed (a later "
                "dist_checkpointing.save into this directory wrote it: a save the store refused, or one not "
                "finalized yet): its common state does not belong with the tensors. Load another checkpoint "
                "(store.latest_checkpoint()), or delete this one with store.delete(id) and save it again"
            )
        self._verified = seen
