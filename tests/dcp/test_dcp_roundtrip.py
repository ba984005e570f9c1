"""Single-process dcp.save / dcp.async_save round trips: training state, dtypes, layouts, plan caching."""

from __future__ import annotations

import dataclasses
import time
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_state import (
    Trainer,
    assert_tree_equal,
    async_save,
    bits,
    blank_like,
    load,
    load_fresh,
    save,
    snapshot,
)
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.testing._internal.two_tensor import TwoTensor

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter, MemStore
from dcp_memstore.dcp.metadata_codec import decode_metadata, encode_metadata, with_stored_dtypes
from dcp_memstore.store.layout import objects_name
from dcp_memstore.store.manifest import ManifestItem, ShardLocation


def _save(mode, store, sd, cid, **kw):
    if mode == "save":
        save(store, sd, cid, **kw)
    else:
        async_save(store, sd, cid, **kw).result()


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_training_state_round_trips_bit_exact_and_training_resumes_identically(store, mode):
    tr = Trainer(seed=0)
    sd = tr.state_dict()
    expected = snapshot(sd)
    _save(mode, store, sd, "step-2")
    assert store.list_checkpoints() == ["step-2"]

    other = Trainer(seed=1)  # different weights, optimizer moments and step
    target = other.state_dict()
    target.update(
        step=0, run_name="other", schedule=blank_like(sd["schedule"]), rng=torch.zeros_like(sd["rng"])
    )
    target["data_rng"] = torch.zeros_like(sd["data_rng"])
    load(store, target, "step-2")
    assert_tree_equal(expected, target)

    # Resume: restoring the loaded state into fresh objects continues exactly like the original run.
    other.model.load_state_dict(target["model"])
    other.optim.load_state_dict(target["optim"])
    other.data.set_state(target["data_rng"])
    for _ in range(3):
        tr.step()
        other.step()
    for a, b in zip(tr.params(), other.params(), strict=True):
        assert torch.equal(a, b)
    torch.set_rng_state(target["rng"])
    after_load = torch.rand(8)
    torch.set_rng_state(expected["rng"])
    assert torch.equal(after_load, torch.rand(8))


def test_async_save_is_isolated_from_training_after_it_returns(store):
    tr = Trainer(seed=3)
    sd = tr.state_dict()
    expected = snapshot(sd)
    fut = async_save(store, sd, "step-2")
    for _ in range(3):  # training goes on while the save is written
        tr.step()
    sd["model"]["0.weight"].add_(1.0)
    sd["schedule"]["milestones"].append(3000)
    fut.result()
    assert_tree_equal(expected, load_fresh(store, expected, "step-2"))


def _odd_tensors() -> dict:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(6, 10, generator=g)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -3.5])
    return {
        "f16": torch.randn(33, generator=g).half(),
        "bf16": torch.randn(4, 9, generator=g).to(torch.bfloat16),
        "f64": torch.randn(5, generator=g, dtype=torch.float64),
        "i64": torch.randint(-(1 << 62), 1 << 62, (17,), generator=g, dtype=torch.int64),
        "i8": torch.randint(-128, 128, (13,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 256, (3, 5), generator=g, dtype=torch.uint8),
        "bool": torch.rand(21, generator=g) > 0.5,
        "c64": torch.randn(7, generator=g, dtype=torch.complex64),
        "c128": torch.randn(3, generator=g, dtype=torch.complex128),
        "i16": torch.randint(-(1 << 15), 1 << 15, (11,), generator=g, dtype=torch.int16),
        "i32": torch.randint(-(1 << 31), 1 << 31, (11,), generator=g, dtype=torch.int32),
        **{  # every bit pattern of these byte-sized and unsigned types, NaN payloads included
            str(dt).removeprefix("torch."): torch.arange(256, dtype=torch.uint8).repeat(dt.itemsize).view(dt)
            for dt in (
                torch.float8_e4m3fn,
                torch.float8_e5m2,
                torch.float8_e8m0fnu,
                torch.float4_e2m1fn_x2,
                torch.uint16,
                torch.uint32,
                torch.uint64,
            )
        },
        "special": special,
        "special_bf16": special.to(torch.bfloat16),
        "scalar_f": torch.tensor(3.25),
        "scalar_i": torch.tensor(-9, dtype=torch.int64),
        "scalar_b": torch.tensor(True),
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.arange(4.0).expand(3, 4),
        "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "empty": torch.empty(0, 4),
        "one_byte": torch.tensor([7], dtype=torch.uint8),
    }


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_dtypes_scalars_and_non_contiguous_tensors_round_trip_bit_exact(store, mode):
    sd = _odd_tensors()
    assert not sd["transposed"].is_contiguous() and not sd["strided"].is_contiguous()
    expected = snapshot(sd)
    _save(mode, store, sd, "odd")
    out = load_fresh(store, expected, "odd")
    assert_tree_equal(expected, out)
    assert bits(out["special"])[4:8].tolist() != [0, 0, 0, 0]  # -0.0 kept its sign bit


def test_a_load_sees_the_dcp_metadata_that_filesystemwriter_records(store, tmp_path):
    """What DCP recorded of every value (dtype, size, chunks, tensor properties and, from torch 2.15 on,
    strides) and the planner's data reach a load as DCP's own pickled metadata gives them, also for
    non-contiguous tensors."""
    sd = {**_odd_tensors(), "nested": {"step": 3, "name": "run"}}
    save(store, sd, "m")
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    reader = MemoryStorageReader(store)
    reader.reset("m")
    ours, stock = reader.read_metadata(), dcp.FileSystemReader(tmp_path).read_metadata()
    assert ours.state_dict_metadata == stock.state_dict_metadata
    assert ours.planner_data == stock.planner_data


class _OneScratchPlanner(DefaultLoadPlanner):
    """Reads every tensor through one scratch buffer and copies it out in ``commit_tensor``, which DCP's
    contract allows (``resolve_tensor`` and ``commit_tensor`` are called in pair for each tensor); asserts
    the pairing, as Megatron's MCoreLoadPlanner does for its FP8 intermediates."""

    def __init__(self) -> None:
        super().__init__()
        self.scratch = torch.empty(1 << 12, dtype=torch.float64)
        self.pending = None

    def resolve_tensor(self, read_item):
        target = super().resolve_tensor(read_item)
        assert self.pending is None, "a resolve_tensor before the commit_tensor of the one before"
        self.pending = (read_item, target)
        return self.scratch.view(torch.uint8)[: target.nbytes].view(target.dtype).view(target.shape)

    def commit_tensor(self, read_item, tensor):
        item, target = self.pending
        assert item is read_item, "a commit_tensor of another item than the one resolved"
        target.copy_(tensor)
        self.pending = None


def test_a_planner_with_its_own_resolve_and_commit_gets_them_in_pair(store):
    """A planner that keeps state from ``resolve_tensor`` to ``commit_tensor`` gets each tensor's two calls
    in turn, with the tensor read in between, as from FileSystemReader (once all resolved first: every
    tensor got the last one's bytes)."""
    sd = {
        "a": torch.arange(16, dtype=torch.float32),
        "b": torch.randn(3, 5).to(torch.bfloat16),
        "c": torch.arange(7),
        "t": torch.randn(6, 4).t(),
        "nested": {"step": 3, "name": "run"},
    }
    save(store, sd, "p")
    assert_tree_equal(load(store, blank_like(sd), "p", planner=_OneScratchPlanner()), sd)


def test_keys_named_like_the_codecs_tuple_tag_round_trip(store, tmp_path):
    """DCP's metadata is stored without pickling, tuples under a tag; a state dict whose one key is that
    tag (and values of a custom planner's data keyed by it) come back as dicts, not tuples."""
    sd = {"__tuple__": torch.arange(4)}
    save(store, sd, "tag")
    assert_tree_equal(load_fresh(store, snapshot(sd), "tag"), sd)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    reader = MemoryStorageReader(store)
    reader.reset("tag")
    assert reader.read_metadata().planner_data == dcp.FileSystemReader(tmp_path).read_metadata().planner_data
    data = {"a": {"__tuple__": ("x", 1)}, "b": {"__tuple__": {"__tuple__": []}}, "c": ({"__tuple__": 2},)}
    md = Metadata(state_dict_metadata={}, planner_data=data)
    assert decode_metadata(encode_metadata(md), {}).planner_data == data


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_the_metadata_says_unpinned_whatever_memory_the_save_was_staged_in(store, monkeypatch, mode):
    """On a GPU machine the staged copies DCP plans an async save from are views of page-locked shard
    files, so DCP records ``pin_memory=True`` for every tensor; DCP's
    ``load_sharded_optimizer_state_dict`` then allocates CUDA tensors with ``pin_memory=True``, which
    torch refuses. The metadata says False instead, on any machine. Here (no CUDA) every tensor is made
    to report itself pinned, as the registered mappings do there (a stand-in, said so: page-locked memory
    needs CUDA)."""
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *args: True)
    sd = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    _save(mode, store, sd, "p")
    reader = MemoryStorageReader(store)
    reader.reset("p")
    entries = reader.read_metadata().state_dict_metadata
    assert {k: e.properties.pin_memory for k, e in entries.items()} == {"w": False, "b": False}


# The fields of DCP's metadata classes that dcp_memstore/dcp/metadata_codec.py stores (a TensorProperties'
# layout is not stored: DCP saves strided tensors only, and a decoded one says so).
_CODEC_FIELDS = {
    Metadata: {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"},
    TensorProperties: {"dtype", "layout", "requires_grad", "memory_format", "pin_memory", "strides"},
    TensorStorageMetadata: {"properties", "size", "chunks"},
    ChunkStorageMetadata: {"offsets", "sizes"},
    StorageMeta: {"checkpoint_id", "save_id", "load_id", "modules"},
}


@pytest.mark.parametrize("cls", list(_CODEC_FIELDS), ids=lambda c: c.__name__)
def test_the_manifest_stores_every_field_of_dcps_metadata(cls):
    """A torch release that adds a field to DCP's metadata (torch 2.15 added strides) fails here, under
    ``nox -s compat``, instead of having the field dropped from every manifest without a word."""
    new = {f.name for f in dataclasses.fields(cls)} - _CODEC_FIELDS[cls]
    assert not new, f"DCP's {cls.__name__} has fields {sorted(new)} that dcp/metadata_codec.py does not store"


def test_the_metadata_of_a_tensor_whose_chunks_were_written_in_two_dtypes_is_refused():
    """DCP's metadata has one dtype a tensor: chunks written with two (ranks that cast differently) are
    refused at the commit, naming the tensor and the dtypes, instead of committing what no load reads."""
    chunks = [
        ChunkStorageMetadata(torch.Size([0]), torch.Size([4])),
        ChunkStorageMetadata(torch.Size([4]), torch.Size([4])),
    ]
    md = Metadata(
        {"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([8]), chunks)}
    )
    items = [
        ManifestItem("w", (0,), ShardLocation("__0_0.shard", 0, 16, 0, "float32", (4,))),
        ManifestItem("w", (4,), ShardLocation("__1_0.shard", 0, 32, 0, "float64", (4,))),
    ]
    with pytest.raises(ValueError, match=r"tensor 'w' were written as \['float32', 'float64'\]"):
        with_stored_dtypes(md, items)
    assert with_stored_dtypes(md, items[:1]) is md  # as the metadata says: left as it is


def test_load_into_non_contiguous_destinations(store):
    sd = {"w": torch.randn(6, 4), "c": torch.randn(2, 3, 4, 5)}
    save(store, sd, "s")
    buf = torch.zeros(4, 6)
    dst = {"w": buf.t(), "c": torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)}
    load(store, dst, "s")
    assert torch.equal(buf.t(), sd["w"])
    assert torch.equal(dst["c"], sd["c"])


_ALIASES = {
    "tied": lambda base, n: {"a": base[:n], "b": base[:n]},  # one tensor under two keys
    "overlapping-views": lambda base, n: {"a": base[:n], "b": base[n // 2 : n // 2 + n]},
}


@pytest.mark.parametrize("alias", list(_ALIASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["whole-reads", "converting-reads"])
@pytest.mark.parametrize("mode", ["save", "async_save"])  # files read with pread / through the mapping
def test_destinations_that_share_memory_get_what_filesystemreader_gives_every_time(
    store, shm_dir, monkeypatch, mode, dtype, alias
):
    """Tied weights loading a checkpoint saved untied, or overlapping views: two items go into the same
    memory. Their files were read in parallel threads, so which item won was random, and a thread hashing
    the bytes it had just copied could hash the other's: ChecksumMismatchError on an intact checkpoint.
    As with FileSystemReader, the item later in the plan wins."""
    n = 1 << 18
    sd = {"a": torch.ones(n), "b": torch.full((n,), 2.0)}  # two shard files: the store has two io threads
    _save(mode, store, sd, "untied")
    dcp.save(sd, checkpoint_id=shm_dir / "fs", no_dist=True)
    expected = torch.zeros(n + n // 2, dtype=dtype)
    dcp.load(_ALIASES[alias](expected, n), checkpoint_id=shm_dir / "fs", no_dist=True)
    assert torch.equal(expected[n // 2 : n], torch.full((n // 2,), 2.0, dtype=dtype))  # "b" came last

    read_file = MemoryStorageReader._read_file_or_fall_back

    def a_late(self, reads):  # fault injection: "a" is read after "b" wherever the two run in parallel
        if any(r.req.storage_index.fqn == "a" for r in reads):
            time.sleep(0.05)
        return read_file(self, reads)

    with monkeypatch.context() as m:
        m.setattr(MemoryStorageReader, "_read_file_or_fall_back", a_late)
        base = torch.zeros(n + n // 2, dtype=dtype)
        load(store, _ALIASES[alias](base, n), "untied")
        assert torch.equal(base, expected)
    for _ in range(40):  # and the race as it comes, where the copies and hashes also interleave
        base = torch.zeros(n + n // 2, dtype=dtype)
        load(store, _ALIASES[alias](base, n), "untied")
        assert torch.equal(base, expected)


@pytest.mark.parametrize("mode", ["save", "async_save"])  # files read with pread / through the mapping
def test_load_into_a_tensor_subclass_destination_fills_it_as_filesystemreader_does(store, mode):
    """A wrapper subclass's bytes are not its values: the read goes through its copy_ (before, a pread or
    memmove into its storage raised EFAULT or crashed the process)."""
    sd = {"w": torch.randn(4, 4)}
    _save(mode, store, sd, "s")
    dest = {"w": TwoTensor(torch.zeros(4, 4), torch.zeros(4, 4))}
    load(store, dest, "s")
    assert torch.equal(dest["w"].a, sd["w"]) and torch.equal(dest["w"].b, sd["w"])


def test_a_tensor_in_a_value_dcp_pickles_is_a_copy_of_its_own_not_a_view_of_a_shard_file(shm_dir):
    """DCP pickles a tuple whole (and a list holding no tensor or dict). async_save used to stage the tensors
    in it too, so each was pickled with the whole storage of its shard file: a 12-byte tensor next to a
    4 MiB one wrote 4 MiB of objects, and loaded with a 4 MiB storage."""
    store = MemStore(root=shm_dir, job_id="job", io_threads=1)  # one shard file for every staged tensor
    small = torch.arange(3.0)
    grad = torch.randn(3, requires_grad=True)  # a tensor computed from it is not a graph leaf
    x = torch.arange(6.0)
    sd = {
        "big": torch.randn(1 << 20),
        "pair": (small, "x"),
        "listed": [("k", small * 2, grad * 2)],
        "views": (x, x[2:4]),  # pickled as views of one storage, as DCP pickles the live tuple
        "param": (torch.nn.Parameter(torch.ones(2)),),
    }
    expected = snapshot(sd)
    fut = async_save(store, sd, "s")
    small.add_(100)  # training goes on: the checkpoint keeps the values of the time of the save
    fut.result()
    objects = store.layout.checkpoint_dir("s") / "__0_objects.bin"
    assert objects.stat().st_size < 64 << 10
    out = load_fresh(store, expected, "s")
    assert_tree_equal(expected, out)
    assert out["pair"][0].untyped_storage().nbytes() == 12
    assert out["listed"][0][1].untyped_storage().nbytes() == 12
    assert out["listed"][0][2].requires_grad  # as DCP's pickle of the live value gives
    whole, part = out["views"]
    assert part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    assert isinstance(out["param"][0], torch.nn.Parameter)
    store.close()


@pytest.mark.parametrize("mode", ["save", "async_save"])  # files read with pread / through the mapping
def test_load_into_conjugate_and_negative_views_gives_the_values_not_their_bytes(store, mode):
    """A conj or neg view's bytes are the conjugate or negation of its values: raw bytes written into its
    storage loaded 1-2j for 1+2j and -1 for 1."""
    sd = {"c": torch.tensor([1 + 2j, 3 - 4j]), "n": torch.tensor([1.0, -2.0])}
    _save(mode, store, sd, "s")
    dest = {"c": torch.zeros(2, dtype=torch.cfloat).conj(), "n": torch._neg_view(torch.zeros(2))}
    load(store, dest, "s")
    assert torch.equal(dest["c"].resolve_conj(), sd["c"]) and torch.equal(dest["n"].resolve_neg(), sd["n"])


def test_values_dcp_pickles_whole_are_copied_as_its_pickle_would_store_them(store):
    """Whatever DCP's pickle takes, async_save's copy takes: copy.deepcopy refused a leaf whose .grad is not
    a leaf and a non-leaf tensor inside an object, and a walk into a value that holds itself never ended."""
    w = torch.arange(1.0, 4.0, requires_grad=True)
    (w.grad,) = torch.autograd.grad((w * w).sum(), w, create_graph=True)  # backward() would warn of a cycle
    looped: dict = {"t": torch.ones(2)}
    looped["self"] = looped
    sd = {"graded": (w,), "object": (types.SimpleNamespace(a=w * 3),), "itself": (looped,)}
    async_save(store, sd, "s").result()
    out = load(store, {k: None for k in sd}, "s")
    assert torch.equal(out["graded"][0], w.detach()) and out["graded"][0].grad is None
    assert torch.equal(out["object"][0].a, (w * 3).detach())
    assert out["itself"][0]["self"] is out["itself"][0] and torch.equal(out["itself"][0]["t"], torch.ones(2))


def test_requires_grad_parameters_round_trip(store):
    tr = Trainer(seed=5)
    sd = {"model": tr.model.state_dict(keep_vars=True)}
    assert all(p.requires_grad for p in sd["model"].values())
    expected = snapshot(sd)
    async_save(store, sd, "s").result()
    out = load(store, {"model": Trainer(seed=6).model.state_dict()}, "s")
    assert_tree_equal(expected, out)


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_plan_caching_over_several_saves_keeps_each_checkpoints_values(shm_dir, clean_plan_cache, mode):
    store = MemStore(root=shm_dir, job_id="job", keep_in_memory=10)
    tr = Trainer(seed=2)
    planner = DefaultSavePlanner(enable_plan_caching=True)
    expected = {}
    for i in range(4):
        tr.step()
        sd = tr.state_dict()
        expected[f"step-{i}"] = snapshot(sd)
        _save(mode, store, sd, f"step-{i}", planner=planner)
    assert store.list_checkpoints() == [f"step-{i}" for i in range(4)]
    for cid, exp in expected.items():
        assert_tree_equal(exp, load_fresh(store, exp, cid))
    assert not torch.equal(expected["step-0"]["model"]["0.weight"], expected["step-3"]["model"]["0.weight"])


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_plan_caching_keeps_a_tensor_whose_dtype_changed_in_its_new_dtype(shm_dir, clean_plan_cache, mode):
    """DCP's save-plan cache compares sizes, not dtypes, so it hands a save whose tensor was cast (a model
    moved to bf16, a 0-dim step counter become a float) the previous save's metadata with the old dtype.
    The checkpoint still loads, bit for bit, in the new dtype, as stock DCP's does; before, it committed
    (evicting the good one) and then could not be read."""
    store = MemStore(root=shm_dir, job_id="job", keep_in_memory=1)
    planner = DefaultSavePlanner(enable_plan_caching=True)
    g = torch.Generator().manual_seed(5)
    w, other = torch.randn(64, 32, generator=g), torch.randn(100, generator=g)
    _save(mode, store, {"w": w, "other": other, "step": torch.tensor(1)}, "fp32", planner=planner)
    cast = {"w": w.to(torch.bfloat16), "other": other, "step": torch.tensor(2.5)}
    expected = snapshot(cast)
    _save(mode, store, cast, "bf16", planner=planner)
    assert store.list_checkpoints() == ["bf16"]
    loaded = load_fresh(store, expected, "bf16")
    assert_tree_equal(expected, loaded)
    assert loaded["w"].dtype == torch.bfloat16 and loaded["step"].dtype == torch.float32
    reader = MemoryStorageReader(store)
    reader.reset("bf16")
    assert reader.read_metadata().state_dict_metadata["w"].properties.dtype == torch.bfloat16


def test_one_writer_can_be_reused_for_many_saves(store):
    writer = MemoryStorageWriter(store)
    expected = {}
    for i in range(3):
        sd = {"w": torch.full((100,), float(i)), "i": i}
        expected[f"s{i}"] = snapshot(sd)
        if i % 2:
            dcp.async_save(sd, checkpoint_id=f"s{i}", storage_writer=writer, no_dist=True).result()
        else:
            dcp.save(sd, checkpoint_id=f"s{i}", storage_writer=writer, no_dist=True)
    assert store.list_checkpoints() == ["s1", "s2"]
    for cid in ("s1", "s2"):
        assert_tree_equal(expected[cid], load_fresh(store, expected[cid], cid))


def test_partial_load_reads_only_requested_keys(store):
    sd = {"a": torch.randn(10), "b": torch.randn(20), "n": 4}
    save(store, sd, "s")
    out = load(store, {"b": torch.zeros(20)}, "s")
    assert torch.equal(out["b"], sd["b"])
    assert list(out) == ["b"]


def _edge_states() -> dict[str, dict]:
    base = torch.arange(100, dtype=torch.float32)
    return {
        "tied": {"a": base, "b": base, "head": base[:10]},
        "only-objects": {"step": 3, "name": "x", "cfg": {"k": [1, 2]}},
        "only-empty-tensor": {"e": torch.empty(0)},
        "empty": {},
    }


@pytest.mark.parametrize("mode", ["save", "async_save"])
@pytest.mark.parametrize("case", list(_edge_states()))
def test_edge_case_state_dicts_round_trip(store, mode, case):
    sd = _edge_states()[case]
    expected = snapshot(sd)
    _save(mode, store, sd, case)
    assert store.list_checkpoints() == [case]
    assert_tree_equal(expected, load_fresh(store, expected, case))


def test_async_save_without_flattening_pickles_nested_tensors_at_their_own_size(store):
    """With ``DefaultSavePlanner(flatten_state_dict=False)`` DCP pickles each top-level dict whole. The
    stager copied the tensors in them into shard files like every other; pickled as views of a file,
    each dict would carry the whole file (here the 4 MiB tensor beside them, once per dict)."""
    big = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    nested = {
        f"group{i}": {"w": torch.full((1000,), float(i)), "step": i, "hist": [torch.arange(10) + i]}
        for i in range(4)
    }
    sd = {"big": big, **nested}
    dcp.async_save(
        sd,
        checkpoint_id="c",
        storage_writer=MemoryStorageWriter(store),
        planner=DefaultSavePlanner(flatten_state_dict=False),
        no_dist=True,
    ).result()
    objects = store.layout.checkpoint_dir("c") / objects_name(0)
    assert objects.stat().st_size < 256 << 10, objects.stat().st_size  # 4 x about 5 KB of values
    out = {"big": torch.empty_like(big), **dict.fromkeys(nested)}
    dcp.load(out, checkpoint_id="c", storage_reader=MemoryStorageReader(store), no_dist=True)
    assert torch.equal(out["big"], big)
    for k, v in nested.items():
        assert torch.equal(out[k]["w"], v["w"]) and torch.equal(out[k]["hist"][0], v["hist"][0])
        assert out[k]["step"] == v["step"] and out[k]["w"].untyped_storage().nbytes() == 4000
