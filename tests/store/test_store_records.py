"""msgpack records (atomic write, size cap, malformed input), Manifest and ShardLocation round trips."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import msgpack
import pytest
import xxhash

from dcp_memstore.store.manifest import FORMAT_VERSION, Manifest, ManifestItem, ShardLocation
from dcp_memstore.store.records import atomic_file, clear_temporaries, read_record, write_atomic, write_record

_KILLED_WRITER = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from dcp_memstore.store.records import atomic_file
with atomic_file(Path(sys.argv[1])) as f:
    f.write(b"half")
    print("writing", flush=True)
    time.sleep(600)
"""


def test_record_round_trip(shm_dir):
    rec = {
        "seq": 3,
        "name": "step-3",
        "blob": b"\x00\xff",
        "nested": [1, 2.5, None, {"k": True}],
        7: "int key",
    }
    write_record(shm_dir / "r", rec)
    assert read_record(shm_dir / "r") == rec


def test_write_replaces_whole_file_and_leaves_no_temporary(shm_dir):
    path = shm_dir / "r"
    write_record(path, {"v": "x" * 10_000})
    write_record(path, {"v": 1})
    assert read_record(path) == {"v": 1}
    assert os.listdir(shm_dir) == ["r"]


def test_readers_never_see_a_partial_record(shm_dir):
    """A reader racing many rewriters sees either the old or the new record, never torn bytes."""
    path = shm_dir / "r"
    write_record(path, {"n": -1, "pad": b"a" * 200_000})
    stop = threading.Event()
    seen, errors = set(), []

    def reader() -> None:
        while not stop.is_set():
            try:
                r = read_record(path)
            except Exception as e:
                errors.append(e)
                return
            assert len(r["pad"]) == 200_000
            seen.add(r["n"])

    t = threading.Thread(target=reader)
    t.start()
    for n in range(200):
        write_record(path, {"n": n, "pad": bytes([n % 256]) * 200_000})
    stop.set()
    t.join()
    assert errors == []
    assert len(seen) > 1
    assert read_record(path)["n"] == 199
    assert os.listdir(shm_dir) == ["r"]


def test_only_the_temporary_file_of_a_killed_writer_is_cleared(tmp_path):
    """A writer SIGKILLed inside atomic_file leaves its temporary file; clear_temporaries removes it, and
    not the one a live writer (this process) is still writing, which then replaces its file as usual."""
    repo = str(Path(__file__).resolve().parents[2])
    killed = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path / "killed"), repo], stdout=subprocess.PIPE
    )
    try:
        assert killed.stdout.readline() == b"writing\n"
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
    (left,) = os.listdir(tmp_path)
    with atomic_file(tmp_path / "live") as f:
        f.write(b"whole")
        assert len(os.listdir(tmp_path)) == 2
        assert clear_temporaries(tmp_path) == [left]
    assert os.listdir(tmp_path) == ["live"] and (tmp_path / "live").read_bytes() == b"whole"


def test_write_that_runs_out_of_space_leaves_old_file_and_no_temporary(small_tmpfs):
    path = small_tmpfs / "r"
    write_record(path, {"v": "old"})
    with pytest.raises(OSError) as ei:
        write_atomic(path, b"x" * (16 << 20))  # twice the 8 MiB tmpfs
    assert ei.value.errno == errno.ENOSPC
    assert read_record(path) == {"v": "old"}
    assert os.listdir(small_tmpfs) == ["r"]


def test_oversized_record_is_refused_before_parsing(shm_dir):
    path = shm_dir / "big"
    write_record(path, {"pad": b"x" * 5000})
    with pytest.raises(ValueError, match=r"more than the 1000 allowed"):
        read_record(path, max_bytes=1000)
    assert read_record(path, max_bytes=10_000)["pad"] == b"x" * 5000


@pytest.mark.parametrize(
    "data",
    [b"\xc1", b"\x92\x01", b"\x81\xa1k", b"", b"\x91\x01trailing"],
    ids=["reserved-byte", "truncated-array", "truncated-map", "empty", "trailing-bytes"],
)
def test_malformed_msgpack_is_a_valueerror_naming_the_file(shm_dir, data):
    path = shm_dir / "bad"
    path.write_bytes(data)
    with pytest.raises(ValueError, match="not a valid dcp_memstore record") as ei:
        read_record(path)
    assert str(path) in str(ei.value)


def test_missing_record_is_filenotfound(shm_dir):
    with pytest.raises(FileNotFoundError):
        read_record(shm_dir / "absent")


def test_read_record_does_not_unpickle_ext_types(shm_dir):
    """Ext types (how a pickle could be smuggled in) come back as inert ExtType values."""
    path = shm_dir / "ext"
    path.write_bytes(msgpack.packb({"x": msgpack.ExtType(5, b"cos\nsystem\n")}))
    r = read_record(path)
    assert isinstance(r["x"], msgpack.ExtType)


def test_shard_location_round_trip():
    for loc in (
        ShardLocation("__0_1.shard", 4096, 1234, 0xDEADBEEF, "bfloat16", (3, 0, 7)),
        ShardLocation("__1_objects.bin", 0, 17, 0),
        ShardLocation("__0_0.shard", 64, 4, 1, "float32", ()),
    ):
        r = msgpack.unpackb(msgpack.packb(loc.to_record()), raw=False)
        assert ShardLocation.from_record(r) == loc


def _manifest() -> Manifest:
    return Manifest(
        checkpoint_id="step-9",
        world_size=2,
        items=[
            ManifestItem("model.w", (0, 0), ShardLocation("__0_0.shard", 0, 400, 11, "float32", (10, 10))),
            ManifestItem("model.w", (10, 0), ShardLocation("__1_0.shard", 0, 400, 12, "float32", (10, 10))),
            ManifestItem("step", None, ShardLocation("__0_objects.bin", 0, 9, 13)),
        ],
        dcp={"planner_data": {"step": {"__tuple__": ["step"]}}, "version": "1.0.0"},
    )


def test_manifest_round_trip_through_disk(shm_dir):
    m = _manifest()
    m.write(shm_dir / "manifest.msgpack")
    back = Manifest.read(shm_dir / "manifest.msgpack")
    assert back == m
    assert back.files == {"__0_0.shard": 400, "__1_0.shard": 400, "__0_objects.bin": 9}
    assert back.nbytes == 809


def _encoded(record: object, fmt: object = FORMAT_VERSION, algorithm: str = "xxh3_64") -> bytes:
    """``record`` as a manifest file holds it, with a digest that matches (what a writer that means it
    would write), so only the record's content is wrong."""
    body = msgpack.packb(record, use_bin_type=True)
    return msgpack.packb(
        {"format": fmt, "checksum": algorithm, "digest": xxhash.xxh3_64_intdigest(body), "body": body},
        use_bin_type=True,
    )


@pytest.mark.parametrize(
    ("encode", "reason"),
    [
        (lambda r: _encoded(r, fmt=FORMAT_VERSION + 1), "unsupported manifest"),
        (lambda r: _encoded(r, algorithm="md5"), "unsupported manifest"),
        (
            lambda r: msgpack.packb({"format": 1, "checksum": "xxh3_64", **r}),
            r"unsupported manifest \(format 1",
        ),
        (lambda r: _encoded([1, 2, 3]), "TypeError"),
        (lambda r: _encoded({k: v for k, v in r.items() if k != "items"}), "KeyError: 'items'"),
        (lambda r: _encoded({**r, "items": [["w", None, ["f", 0, 1]]]}), "ValueError|not enough values"),
        (lambda r: _encoded({**r, "items": [["w", None, ["../x", 0, 1, 0, None, None]]]}), "file name"),
        (lambda r: b"\xc1", "not a valid dcp_memstore record"),
    ],
    ids=[
        "future-format",
        "other-checksum",
        "format-1-without-digest",
        "record-not-a-map",
        "missing-items",
        "short-location",
        "file-outside-the-checkpoint",
        "not-msgpack",
    ],
)
def test_unusable_manifest_is_a_valueerror_naming_the_file_once(shm_dir, encode, reason):
    path = shm_dir / "manifest.msgpack"
    path.write_bytes(encode(_manifest().to_record()))
    with pytest.raises(ValueError, match=reason) as ei:
        Manifest.read(path)
    assert str(ei.value).count(str(path)) == 1
    assert "load another checkpoint" in str(ei.value)


def test_every_bit_flip_of_a_manifest_is_refused_naming_it():
    m = _manifest()
    good = m.encode()
    for bit in range(len(good) * 8):
        damaged = bytearray(good)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ValueError, match=r"^peer-copy/manifest\.msgpack: ") as ei:
            Manifest.decode(bytes(damaged), "peer-copy/manifest.msgpack", "step-9")
        assert "load another checkpoint" in str(ei.value), f"bit {bit}: {ei.value}"
    assert Manifest.decode(good, "peer-copy/manifest.msgpack", "step-9") == m


def test_a_manifest_of_another_checkpoint_is_refused():
    with pytest.raises(ValueError, match="the manifest of 'step-9', not of 'step-10'"):
        Manifest.decode(_manifest().encode(), "m", "step-10")


@pytest.mark.parametrize(
    ("location", "expected"),
    [
        (
            ["__0_0.shard", 0, 400, 11, "float32", [10, 11]],
            "is 400 bytes long, but float32 of shape [10, 11] takes 440",
        ),
        (
            ["__0_0.shard", 0, 400, 11, "float64", [10, 10]],
            "is 400 bytes long, but float64 of shape [10, 10] takes 800",
        ),
        (
            ["__0_0.shard", 0, 400, 11, "float32", [-10, -10]],
            "is 400 bytes long, but float32 of shape [-10, -10]",
        ),
        (["__0_0.shard", 0, 400, 11, "float32", None], "has a dtype but no shape"),
        (["__0_0.shard", 0, 400, 11, "no_such_dtype", [10, 10]], "unknown dtype 'no_such_dtype'"),
    ],
    ids=["shape", "dtype", "negative-shape", "no-shape", "unknown-dtype"],
)
def test_item_whose_length_its_dtype_and_shape_do_not_take_is_refused_naming_file_and_item(
    shm_dir, location, expected
):
    r = _manifest().to_record()
    r["items"][0][2] = location
    path = shm_dir / "manifest.msgpack"
    path.write_bytes(_encoded(r))
    with pytest.raises(ValueError) as ei:
        Manifest.read(path)
    msg = str(ei.value)
    assert msg.startswith(f"{path}: ")
    assert expected in msg
    if "unknown dtype" not in expected:
        assert "item model.w (chunk at (0, 0))" in msg
