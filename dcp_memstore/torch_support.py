"""The torch releases dcp_memstore works with, checked when the package is imported.

The store plugs into DCP's save and load sequence, which changed between releases: torch 2.9's
``dcp.async_save`` sets the writer up for its checkpoint in the caller's thread before staging and again
in its executor thread (so a save waits on staged saves it should not), 2.8 and older have no ``no_dist``
for ``async_save`` and no ``version`` in DCP's ``Metadata`` (every save fails as it commits). The test
suite passes on 2.10 to 2.15 (``nox -s compat``, docs/compatibility.md). An older torch gets an
ImportError that says what to install, instead of saves that fail later.
"""

from __future__ import annotations

import re

MIN_TORCH = (2, 10)


def require_supported_torch(version: str) -> None:
    """ImportError naming ``version`` (a ``torch.__version__``) and what to install if that torch is older
    than ``MIN_TORCH``. A version that does not start with two numbers is let through."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is not None and (int(m[1]), int(m[2])) < MIN_TORCH:
        floor = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"dcp_memstore needs torch >= {floor}; this is torch {version}, whose "
            "torch.distributed.checkpoint saves differently. Install a newer one, "
            f"e.g. pip install 'torch>={floor}'"
        )
