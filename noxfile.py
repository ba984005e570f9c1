"""Developer sessions: ``nox -s tests``, ``nox -s demo``, ``nox -s bench``, ``nox -s bench_persist``,
``nox -s bench_replication``, ``nox -s bench_megatron``, ``nox -s example``,
``nox -s lint``, ``nox -s compat``.

Every session installs torch 2.13.0 first, by exact version, so that installing this package (whose
dependency on torch is a range) never pulls another torch build. ``DCP_MEMSTORE_TORCH`` replaces that
requirement (for example with a CUDA build of torch on a GPU machine); the
sessions then pin that one instead.
"""

from __future__ import annotations

import os

import nox
import tomllib

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH = os.environ.get("DCP_MEMSTORE_TORCH", "torch==2.13.0")
# The oldest torch the package supports (dcp_memstore/torch_support.py) and the newest one tested.
COMPAT_TORCH = ("2.10.0", "2.15.0")


def _install(session: nox.Session, extras: str = "dev", torch: str = TORCH) -> None:
    session.install(torch)
    spec = f".[{extras}]" if extras else "."
    session.install("-e", spec, "--constraint", _constraints(session, torch))


def _constraints(session: nox.Session, torch: str) -> str:
    """A pip constraints file pinning torch to the version just installed, for every later install."""
    path = os.path.join(session.create_tmp(), "constraints.txt")
    with open(path, "w") as f:
        f.write(torch + "\n")
    return path


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The test suite (GPU tests skip without CUDA; the Megatron-Core strategies are tested too)."""
    _install(session, "dev,megatron")
    session.run("pytest", "-q", "--durations=25", *session.posargs)  # the slowest tests, in CI's log too


@nox.session(python="3.11")
@nox.parametrize("torch", COMPAT_TORCH)
def compat(session: nox.Session, torch: str) -> None:
    """The test suite under the oldest supported torch and the newest tested one (not run by CI).

    The ``tests`` session pins one release; this one checks the range the package claims
    (docs/compatibility.md). PyPI's torch builds for Linux are CUDA builds of several GB each, which is
    why CI does not run it."""
    _install(session, "dev,megatron", torch=f"torch=={torch}")
    session.run("pytest", "-q", *session.posargs)


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """Train with async checkpoints, SIGKILL a rank mid-run, resume, and compare bit for bit."""
    _install(session, "")  # the package alone: the demo needs nothing else
    session.run("python", "examples/demo.py", *session.posargs)


@nox.session(python="3.11")
def example(session: nox.Session) -> None:
    """Train a small GPT on 2 ranks, SIGKILL a rank, resume, and plot both loss curves (bit-identical)."""
    _install(session, "examples")
    session.run("python", "examples/train_gpt.py", *session.posargs)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """The core benchmark: save/load throughput against FileSystemWriter and the memcpy bound."""
    _install(session)
    session.run("python", "benchmarks/bench_core.py", *session.posargs)


@nox.session(python="3.11")
def bench_persist(session: nox.Session) -> None:
    """The persistence benchmark: upload throughput against raw s3fs and step time with persistence on/off."""
    _install(session)
    session.run("python", "benchmarks/bench_persist.py", *session.posargs)


@nox.session(python="3.11")
def bench_replication(session: nox.Session) -> None:
    """The replication benchmark across two network namespaces: put_file/get_file against raw sockets, and
    (--step-time) training step time with replication on/off. Needs root (ip netns, tmpfs mounts)."""
    _install(session)
    session.run("python", "benchmarks/bench_replication.py", *session.posargs)


@nox.session(python="3.11")
def bench_megatron(session: nox.Session) -> None:
    """Megatron-Core save/load through our strategies against its torch-dist strategy on the same tmpfs."""
    _install(session, "dev,megatron")
    session.run("python", "benchmarks/bench_megatron.py", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check of the Python sources, with the ruff pinned in the ``dev`` extra
    (a new ruff release brings new rules and formatting, which would fail CI on unchanged code)."""
    session.install(_pinned_ruff())
    paths = ("dcp_memstore", "tests", "examples", "benchmarks", "noxfile.py")
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


def _pinned_ruff() -> str:
    """The ``ruff==...`` requirement of pyproject.toml's ``dev`` extra, its one place."""
    with open("pyproject.toml", "rb") as f:
        dev = tomllib.load(f)["project"]["optional-dependencies"]["dev"]
    return next(req for req in dev if req.startswith("ruff=="))
