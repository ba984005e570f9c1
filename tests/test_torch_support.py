"""The torch check at import: a torch older than the package supports is refused with what to install,
before any save could fail on it (docs/compatibility.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dcp_memstore.torch_support import MIN_TORCH, require_supported_torch

FLOOR = ".".join(map(str, MIN_TORCH))


@pytest.mark.parametrize("version", ["2.9.1+cu128", "2.7.0", "1.13.1", "2.9.0a0+git1234abc"])
def test_a_torch_older_than_the_floor_is_refused_naming_it_and_what_to_install(version):
    with pytest.raises(ImportError) as ei:
        require_supported_torch(version)
    msg = str(ei.value)
    assert f"dcp_memstore needs torch >= {FLOOR}; this is torch {version}" in msg
    assert f"pip install 'torch>={FLOOR}'" in msg


@pytest.mark.parametrize(
    "version", [FLOOR, f"{FLOOR}.0+cu128", "2.13.0+cpu", "2.16.0.dev20261120", "3.0.0", "10.1", "local"]
)
def test_the_floor_newer_releases_and_unparsed_versions_pass(version):
    require_supported_torch(version)


def test_importing_the_package_under_an_older_torch_raises_that_error():
    """The check runs when ``dcp_memstore`` is imported, also through a sub-package, before the modules
    that use DCP (the installed torch is made to report an old version)."""
    for module in ("dcp_memstore", "dcp_memstore.megatron"):
        code = f"import torch; torch.__version__ = '2.9.1'; import {module}"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"ImportError: dcp_memstore needs torch >= {FLOOR}; this is torch 2.9.1"), last
