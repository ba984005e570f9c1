"""Page-locking shard file mappings for the GPU (``cudaHostRegister``), so device-to-host copies are DMA
straight into tmpfs pages and host-to-device reads come from pinned pages.

Registration is done once per mapping and kept with it (see ``mapping.py``); where CUDA is absent or the
driver refuses, copies still work, unpinned, and one log line says why.
"""

from __future__ import annotations

import logging

import torch

from dcp_memstore.store.mapping import MappedFile

log = logging.getLogger(__name__)
_warned = False
_CUDA_HOST_REGISTER_PORTABLE = 1


def cuda_available() -> bool:
    return torch.cuda.is_available()


def register_host(mf: MappedFile) -> bool:
    """Pin ``mf``'s pages for CUDA (idempotent). Returns whether the mapping is pinned."""
    global _warned
    if mf.host_registered:
        return True
    if not cuda_available():
        return False
    with mf.lock:
        if mf.host_registered:
            return True
        err = torch.cuda.cudart().cudaHostRegister(mf.address, mf.size, _CUDA_HOST_REGISTER_PORTABLE)
        ok = int(err) == 0 if not hasattr(err, "value") else err.value == 0
        if ok:
            mf.host_registered = True
        elif not _warned:
            _warned = True
            log.warning(
                "cudaHostRegister of a tmpfs mapping failed (%s); GPU copies go through pageable memory", err
            )
        return mf.host_registered


def unregister_host(mf: MappedFile) -> None:
    """Undo ``register_host`` before the mapping goes away."""
    if mf.host_registered:
        torch.cuda.cudart().cudaHostUnregister(mf.address)
        mf.host_registered = False
