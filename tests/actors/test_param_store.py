"""The host shared-memory parameter store: round trips between layouts, atomic versions
across threads and processes, pinning, errors, and no /dev/shm left behind."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pivot.actors.param_store import (
    NoVersion,
    ParameterReader,
    ParameterStore,
    StoreClosed,
    StoreError,
    job_store_name,
    remove_orphaned_stores,
    remove_store,
    slot_name,
)
from pivot.gps import FLAT, LayoutError, TensorLayout

SHM = "/dev/shm"


def gps_segments() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith("pivot-gps-")}


@pytest.fixture(autouse=True, scope="module")
def no_leaked_segments():
    before = gps_segments()
    yield
    assert gps_segments() - before == set()


@pytest.fixture
def one_torch_thread():
    # on a busy 2-core machine torch's OpenMP copies wait on descheduled threads: one
    # thread per process keeps the concurrent test fast
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def split(x: torch.Tensor, mesh: int, rule: str, dim: int) -> list[torch.Tensor]:
    if rule == "balanced":
        return list(torch.tensor_split(x, mesh, dim))
    parts = list(torch.chunk(x, mesh, dim))
    return parts + [x.narrow(dim, x.shape[dim], 0)] * (mesh - len(parts))


def local(full: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
    """What a holder with ``layout`` holds of ``full``, from torch's own splits."""
    if layout.dim is None:
        return full.clone()
    if layout.dim == FLAT:
        parts = split(full.reshape(-1), layout.mesh, layout.rule, 0)
        return torch.cat([parts[i] for i in layout.indices])
    parts = split(full, layout.mesh, layout.rule, layout.dim)
    return torch.cat([parts[i] for i in layout.indices], dim=layout.dim)


# --- round trips ------------------------------------------------------------------------


@st.composite
def partition(draw, shape):
    dim = draw(st.sampled_from([None, FLAT, *range(len(shape))]))
    if dim is None:
        return None, 1, "balanced"
    return dim, draw(st.integers(1, 4)), draw(st.sampled_from(["balanced", "chunk"]))


def layout_of(shape, part, indices) -> TensorLayout:
    dim, mesh, rule = part
    if dim is None:
        return TensorLayout.whole(shape)
    return TensorLayout(shape=shape, dim=dim, mesh=mesh, indices=tuple(sorted(indices)), rule=rule)


@st.composite
def round_trips(draw):
    """Tensors; writer shards that together cover them; one reader's layouts."""
    names = draw(st.lists(st.sampled_from(["w", "b", "emb"]), min_size=1, max_size=3, unique=True))
    n_shards = draw(st.integers(1, 3))
    shards: list[dict[str, TensorLayout]] = [{} for _ in range(n_shards)]
    reader: dict[str, TensorLayout] = {}
    full = {}
    for name in names:
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
        full[name] = torch.arange(1, math.prod(shape) + 1).reshape(shape).to(dtype)
        part = draw(partition(shape))
        for i in range(part[1]):
            owners = draw(st.sets(st.integers(0, n_shards - 1), min_size=1))
            for o in owners:
                held = shards[o].get(name)
                idx = {i} | set(held.indices if held else ())
                shards[o][name] = layout_of(shape, part, idx)
        if draw(st.booleans()) or not reader:
            rpart = draw(partition(shape))
            reader[name] = layout_of(
                shape, rpart, draw(st.sets(st.integers(0, rpart[1] - 1), min_size=1))
            )
    return full, [s for s in shards if s], reader


@settings(max_examples=60, deadline=None)
@given(round_trips())
def test_a_reader_gets_exactly_what_the_writer_wrote_in_its_own_layout(case):
    full, shard_layouts, reader_layouts = case
    shards = [({n: local(full[n], lay) for n, lay in s.items()}, s) for s in shard_layouts]
    with ParameterStore() as store, ParameterReader(store.name) as reader:
        version = store.write_shards(shards)
        into = {
            n: torch.zeros(lay.local_shape(), dtype=full[n].dtype)
            for n, lay in reader_layouts.items()
        }
        assert reader.read(into, reader_layouts) == version
        for n, lay in reader_layouts.items():
            assert torch.equal(into[n], local(full[n], lay)), n


def test_whole_state_round_trip_and_a_second_read_reuses_its_plan():
    state = {"w": torch.randn(8, 16), "b": torch.randn(16).to(torch.bfloat16)}
    with ParameterStore() as store, ParameterReader(store.name, name="rollout-0") as reader:
        assert store.write(state) == 1
        into = {k: torch.empty_like(v) for k, v in state.items()}
        assert reader.read(into) == 1
        assert all(torch.equal(into[k], state[k]) for k in state)
        assert (reader.planner.hits, reader.planner.misses) == (0, 1)
        store.write({k: v * 2 for k, v in state.items()})
        assert reader.read(into) == 2
        assert torch.equal(into["w"], state["w"] * 2)
        assert (reader.planner.hits, reader.planner.misses) == (1, 1)


def test_a_reader_may_read_a_subset_and_cast():
    with ParameterStore() as store, ParameterReader(store.name) as reader:
        store.write({"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)})
        into = {"w": torch.empty(3, 2, dtype=torch.bfloat16)}
        reader.read(into, {"w": TensorLayout.sharded((3, 4), 1, 2, 1)})
        assert torch.equal(into["w"], torch.arange(12.0).reshape(3, 4)[:, 2:].bfloat16())


# --- versions ---------------------------------------------------------------------------


def test_a_read_during_a_write_gets_the_previous_complete_version():
    with ParameterStore() as store, ParameterReader(store.name) as reader:
        store.write({"w": torch.full((64,), 1.0)})
        filled, go_on = threading.Event(), threading.Event()
        fill = store._fill

        def slow_fill(*args):
            fill(*args)
            filled.set()
            go_on.wait(10)

        store._fill = slow_fill  # pause between filling version 2 and publishing it
        writer = threading.Thread(target=store.write, args=({"w": torch.full((64,), 2.0)},))
        writer.start()
        try:
            assert filled.wait(10)
            into = {"w": torch.zeros(64)}
            assert reader.read(into) == 1
            assert torch.equal(into["w"], torch.full((64,), 1.0))
        finally:
            go_on.set()
            writer.join()
        assert reader.read(into) == 2
        assert torch.equal(into["w"], torch.full((64,), 2.0))


def test_slots_are_recycled_but_never_while_a_reader_holds_one():
    with ParameterStore() as store, ParameterReader(store.name) as reader:
        into = {"w": torch.zeros(256)}
        for v in range(1, 6):
            store.write({"w": torch.full((256,), float(v))})
            assert reader.read(into) == v
        assert store.slots == 2  # the published one and one spare

        entered, go_on = threading.Event(), threading.Event()
        copy = reader._copy

        def slow_copy(*args):
            entered.set()
            go_on.wait(10)
            copy(*args)

        reader._copy = slow_copy  # hold version 5's slot, mid-read
        result = []
        paused = threading.Thread(target=lambda: result.append(reader.read(into)))
        paused.start()
        try:
            assert entered.wait(10)
            for v in range(6, 9):
                store.write({"w": torch.full((256,), float(v))})
            assert store.slots == 3  # the held one, the published one, a spare
        finally:
            go_on.set()
            paused.join()
        assert result == [5]
        assert torch.equal(into["w"], torch.full((256,), 5.0))
        reader._copy = copy
        assert reader.read(into) == 8
        store.write({"w": torch.full((256,), 9.0)})
        assert store.slots == 2  # the held slot was freed and trimmed
    assert not any(n.startswith(store.name) for n in os.listdir(SHM))


def test_versions_must_increase():
    with ParameterStore() as store:
        assert store.write({"w": torch.ones(2)}, version=5) == 5
        with pytest.raises(StoreError, match="versions must increase: published 5"):
            store.write({"w": torch.ones(2)}, version=5)
        assert store.write({"w": torch.ones(2)}) == 6


SHAPE = (512, 256)  # 512 KiB of float32 per tensor: copies take long enough to overlap
LAST = 120


def _read_until_last(store: str, last: int, results) -> None:
    torch.set_num_threads(1)  # a forked child must not touch the parent's OpenMP pool
    try:
        reads, previous = 0, 0
        layouts = {
            "a": TensorLayout.sharded(SHAPE, 0, 3, [0, 2]),
            "b": TensorLayout.flat_range(SHAPE, 4, 1),
        }
        into = {n: torch.empty(lay.local_shape()) for n, lay in layouts.items()}
        with ParameterReader(store, name=f"reader-{os.getpid()}") as reader:
            deadline = time.monotonic() + 60
            while previous < last and time.monotonic() < deadline:
                version = reader.read(into, layouts)
                for name, t in into.items():
                    if not bool((t == version).all()):
                        lo, hi = float(t.min()), float(t.max())
                        results.put(f"torn: version {version}, {name} in [{lo}, {hi}]")
                        return
                if version < previous:
                    results.put(f"went back from {previous} to {version}")
                    return
                previous, reads = version, reads + 1
        results.put(("ok", previous, reads))
    except BaseException as exc:  # report, never hang the parent
        results.put(f"error: {exc!r}")


def test_concurrent_readers_never_see_half_a_version(one_torch_thread):
    with ParameterStore() as store:
        store.write({"a": torch.full(SHAPE, 1.0), "b": torch.full(SHAPE, 1.0)})
        ctx = mp.get_context("fork")
        results = ctx.Queue()
        # two reader processes, forked before any thread starts, and one reader thread
        procs = [
            ctx.Process(target=_read_until_last, args=(store.name, LAST, results)) for _ in range(2)
        ]
        for p in procs:
            p.start()
        thread_results: queue.SimpleQueue = queue.SimpleQueue()
        reader_thread = threading.Thread(
            target=_read_until_last, args=(store.name, LAST, thread_results)
        )
        reader_thread.start()
        try:
            for v in range(2, LAST + 1):
                store.write({"a": torch.full(SHAPE, float(v)), "b": torch.full(SHAPE, float(v))})
            reader_thread.join(60)
            outcomes = [results.get(timeout=60) for _ in procs] + [thread_results.get(timeout=1)]
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
    assert [o[:2] for o in outcomes] == [("ok", LAST)] * 3, outcomes
    assert all(p.exitcode == 0 for p in procs)


# --- errors -----------------------------------------------------------------------------


def test_a_write_that_leaves_a_region_uncovered_is_refused_and_publishes_nothing():
    with ParameterStore() as store:
        half = TensorLayout.sharded((4, 2), 0, 2, [0])
        with pytest.raises(LayoutError, match="held by no source"):
            store.write({"w": torch.ones(2, 2)}, {"w": half})
        assert store.version is None
        assert store.slots == 0


def test_shards_must_agree_on_dtype_and_match_their_layouts():
    with ParameterStore() as store:
        lay = [TensorLayout.sharded((4,), 0, 2, i) for i in (0, 1)]
        with pytest.raises(LayoutError, match="dtype torch.float64 in shard1"):
            store.write_shards(
                [
                    ({"w": torch.ones(2)}, {"w": lay[0]}),
                    ({"w": torch.ones(2, dtype=torch.float64)}, {"w": lay[1]}),
                ]
            )
        with pytest.raises(LayoutError, match=r"shard0: tensor 'w' has shape \(3,\)"):
            store.write({"w": torch.ones(3)}, {"w": lay[0]})
        with pytest.raises(LayoutError, match="tensor without layout: \\['b'\\]"):
            store.write({"w": torch.ones(2), "b": torch.ones(1)}, {"w": lay[0]})


def test_reader_errors_name_what_is_wrong():
    with ParameterStore() as store, ParameterReader(store.name, name="rm-0") as reader:
        with pytest.raises(NoVersion):
            reader.read({"w": torch.zeros(4)})
        store.write({"w": torch.ones(4)})
        with pytest.raises(LayoutError, match="'bias' needed by \\['rm-0'\\] is held by no"):
            reader.read({"bias": torch.zeros(4)})
        with pytest.raises(LayoutError, match="shape mismatch"):
            reader.read({"w": torch.zeros(5)})
        with pytest.raises(LayoutError, match="rm-0: tensor 'w' has shape \\(4,\\)"):
            reader.read({"w": torch.zeros(4)}, {"w": TensorLayout.sharded((4,), 0, 2, 0)})
        with pytest.raises(LayoutError, match="must be contiguous"):
            reader.read({"w": torch.zeros(4)[::2]}, {"w": TensorLayout.flat_range((4,), 2, 0)})
        store.close()
        with pytest.raises(StoreClosed):
            reader.read({"w": torch.zeros(4)})
        with pytest.raises(StoreClosed):
            store.write({"w": torch.ones(4)})


def test_attaching_needs_an_existing_store_and_names_are_unique():
    with pytest.raises(StoreError, match="no parameter store named 'pivot-gps-none'"):
        ParameterReader("pivot-gps-none")
    with ParameterStore() as store:
        with pytest.raises(StoreError, match="exists already"):
            ParameterStore(store.name)


def test_close_leaves_nothing_in_dev_shm():
    before = gps_segments()
    store = ParameterStore()
    reader = ParameterReader(store.name)
    for v in range(3):
        store.write({"w": torch.full((1000,), float(v))})
        reader.read({"w": torch.zeros(1000)})
    assert {store.name, slot_name(store.name, 0), slot_name(store.name, 1)} <= gps_segments()
    reader.close()
    store.close()
    store.close()  # idempotent
    assert gps_segments() == before


def test_an_adopted_store_outlives_its_writer_and_the_next_one_goes_on_from_it():
    """A job's store (``adopt``): the writer that stops (or dies) leaves the published version
    readable, to the readers attached all along and to the next writer, which publishes the
    versions after it in the same store; the job removes the segments at its end."""
    name = job_store_name(os.getpid()) + "-adopt"
    first = ParameterStore(name, adopt=True)
    reader = ParameterReader(name)
    for v in (1, 2, 3):
        first.write({"w": torch.full((100,), float(v))}, version=v)
    first.close()  # no unlink: what it published stays
    w = torch.zeros(100)
    assert reader.read({"w": w}) == 3 and w[0] == 3.0
    second = ParameterStore(name, adopt=True)
    assert second.version == 3
    with pytest.raises(StoreError, match="versions must increase"):
        second.write({"w": torch.zeros(100)}, version=3)
    for v in (4, 5, 6):  # recycles the slots the first writer left, never the published one
        second.write({"w": torch.full((100,), float(v))})
    assert reader.read({"w": w}) == 6 and w[0] == 6.0
    assert len([n for n in gps_segments() if n.startswith(name)]) == 1 + second.slots
    second.close()
    reader.close()
    remove_store(name)
    assert not [n for n in gps_segments() if n.startswith(name)]


def test_the_stores_of_dead_jobs_are_removed_and_the_living_ones_kept():
    dead = subprocess_pid()  # a pid that has exited
    orphan = ParameterStore(job_store_name(dead), adopt=True)
    orphan.write({"w": torch.ones(10)})
    orphan.close()
    living = ParameterStore(job_store_name(os.getpid()), adopt=True)
    living.write({"w": torch.ones(10)})
    try:
        assert remove_orphaned_stores() == [job_store_name(dead)]
        names = gps_segments()
        assert job_store_name(dead) not in names and slot_name(job_store_name(dead), 0) not in names
        assert {living.name, slot_name(living.name, 0)} <= names
    finally:
        living.close()
        remove_store(living.name)


def subprocess_pid() -> int:
    import subprocess

    process = subprocess.Popen(["true"])
    process.wait()  # reaped: nothing runs under that pid now
    return process.pid
