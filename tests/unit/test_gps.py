"""GPS planning: layouts, refinement to common slices, link- and load-aware plans, the cache.

Plans are executed here with plain tensor copies (``Access.view``); the expected local
buffers come from torch.tensor_split / torch.chunk, independently of the planner's code.
"""

from __future__ import annotations

import math
import re

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pivot.config import ConfigError, decode_toml
from pivot.gps import (
    FLAT,
    Holder,
    LayoutError,
    Link,
    LinkConfig,
    TensorLayout,
    TransferPlanner,
    part_bounds,
    plan_transfers,
    refine,
)


def split(x: torch.Tensor, mesh: int, rule: str, dim: int) -> list[torch.Tensor]:
    if rule == "balanced":
        return list(torch.tensor_split(x, mesh, dim))
    parts = list(torch.chunk(x, mesh, dim))  # may return fewer: the rest are empty
    return parts + [x.narrow(dim, x.shape[dim], 0)] * (mesh - len(parts))


def reference_local(full: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
    """What a holder with ``layout`` holds of ``full``, built from torch's own splits."""
    if layout.dim is None:
        return full.clone()
    if layout.dim == FLAT:
        parts = split(full.reshape(-1), layout.mesh, layout.rule, 0)
        return torch.cat([parts[i] for i in layout.indices])
    parts = split(full, layout.mesh, layout.rule, layout.dim)
    return torch.cat([parts[i] for i in layout.indices], dim=layout.dim)


def execute(plan, sources: dict, receivers: dict) -> None:
    for name, bufs in receivers.items():
        for t in plan.for_receiver(name):
            src = t.source_access.view(sources[t.source][t.tensor])
            t.receiver_access.view(bufs[t.tensor]).copy_(src)


# --- strategies -------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)


@st.composite
def partitions(draw, shape):
    dim = draw(st.sampled_from([None, FLAT, *range(len(shape))]))
    if dim is None:
        return None, 1, "balanced"
    return dim, draw(st.integers(1, 5)), draw(st.sampled_from(["balanced", "chunk"]))


def make_layout(shape, partition, indices) -> TensorLayout:
    dim, mesh, rule = partition
    if dim is None:
        return TensorLayout.whole(shape)
    return TensorLayout(shape=shape, dim=dim, mesh=mesh, indices=tuple(sorted(indices)), rule=rule)


HOSTS = ["h0", "h1"]
DEVICES = [None, 0, 1]


@st.composite
def scenarios(draw):
    """Tensors; sources that together hold every part of each; receivers in other layouts."""
    names = draw(st.lists(st.sampled_from("abc"), min_size=1, max_size=3, unique=True))
    n_sources = draw(st.integers(1, 3))
    source_layouts: list[dict[str, TensorLayout]] = [{} for _ in range(n_sources)]
    n_receivers = draw(st.integers(1, 3))
    receiver_layouts: list[dict[str, TensorLayout]] = [{} for _ in range(n_receivers)]
    tensor_shapes = {}
    for name in names:
        shape = draw(shapes)
        tensor_shapes[name] = shape
        part = draw(partitions(shape))
        held: list[set[int]] = [set() for _ in range(n_sources)]
        for i in range(part[1]):  # every part held at least once, maybe more
            owners = draw(st.sets(st.integers(0, n_sources - 1), min_size=1))
            for o in owners:
                held[o].add(i)
        for s, idx in enumerate(held):
            if idx:
                source_layouts[s][name] = make_layout(shape, part, idx)
        for r in range(n_receivers):
            if draw(st.booleans()) or r == 0:
                rpart = draw(partitions(shape))
                idx = draw(st.sets(st.integers(0, rpart[1] - 1), min_size=1))
                receiver_layouts[r][name] = make_layout(shape, rpart, idx)

    def holder(prefix, i, layouts):
        return Holder(
            name=f"{prefix}{i}",
            host=draw(st.sampled_from(HOSTS)),
            device=draw(st.sampled_from(DEVICES)),
            layouts=layouts,
        )

    sources = [holder("s", i, lay) for i, lay in enumerate(source_layouts)]
    receivers = [holder("r", i, lay) for i, lay in enumerate(receiver_layouts)]
    return tensor_shapes, sources, receivers


# --- properties -------------------------------------------------------------------------


@settings(max_examples=50)
@given(st.integers(0, 40), st.integers(1, 9))
def test_part_bounds_follow_torch_split_semantics(n, mesh):
    x = torch.arange(n)
    for rule in ("balanced", "chunk"):
        bounds = part_bounds(n, mesh, rule)
        sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
        assert sizes == [len(p) for p in split(x, mesh, rule, 0)]


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_plans_reassemble_exactly_what_each_receiver_holds(scenario):
    tensor_shapes, sources, receivers = scenario
    full = {
        n: torch.arange(1, math.prod(s) + 1, dtype=torch.float64).reshape(s)
        for n, s in tensor_shapes.items()
    }
    itemsize = {n: 8 for n in full}
    plan = plan_transfers(sources, receivers, itemsize)

    source_bufs = {
        s.name: {n: reference_local(full[n], lay) for n, lay in s.layouts.items()} for s in sources
    }
    receiver_bufs = {
        r.name: {
            n: torch.full(lay.local_shape(), -1.0, dtype=torch.float64)
            for n, lay in r.layouts.items()
        }
        for r in receivers
    }
    execute(plan, source_bufs, receiver_bufs)

    by_name = {s.name: s for s in sources}
    for r in receivers:
        delivered = dict.fromkeys(r.layouts, 0)
        for t in plan.for_receiver(r.name):
            delivered[t.tensor] += t.nbytes
            # link first: no holder of this slice had a better link than the one chosen
            holders = [
                s
                for s in sources
                if t.tensor in s.layouts and s.layouts[t.tensor].locate(t.region) is not None
            ]
            assert by_name[t.source] in holders
            assert t.link == min(
                Link.INTER_NODE
                if s.host != r.host
                else Link.LOCAL
                if s.device == r.device
                else Link.INTRA_NODE
                for s in holders
            )
        for n, lay in r.layouts.items():
            assert torch.equal(receiver_bufs[r.name][n], reference_local(full[n], lay))
            # every element arrives exactly once
            assert delivered[n] == math.prod(lay.local_shape()) * 8


# --- refinement -------------------------------------------------------------------------


def test_same_dim_meshes_refine_to_the_union_of_boundaries():
    shape = (12, 2)
    two, three = (
        TensorLayout.sharded(shape, 0, 2, [0, 1]),
        TensorLayout.sharded(shape, 0, 3, [0, 1, 2]),
    )
    five = TensorLayout.sharded(shape, 0, 5, [0, 1, 2, 3, 4])
    slices = refine(TensorLayout.whole(shape), [two, three, five])
    cuts = sorted(set(two.bounds()) | set(three.bounds()) | set(five.bounds()))
    assert [r[0] for r in slices] == list(zip(cuts, cuts[1:], strict=False))
    assert all(r[1] == (0, 2) for r in slices)


def test_different_dims_refine_to_the_product_grid():
    shape = (4, 6)
    rows = TensorLayout.sharded(shape, 0, 2, [0, 1])
    cols = TensorLayout.sharded(shape, 1, 3, [0, 1, 2])
    slices = refine(rows, [cols])
    assert len(slices) == 2 * 3
    assert {r[0] for r in slices} == {(0, 2), (2, 4)}
    assert {r[1] for r in slices} == {(0, 2), (2, 4), (4, 6)}


def test_a_flat_range_is_cut_into_contiguous_boxes():
    shape = (3, 4)
    layout = TensorLayout.flat_range(shape, 2, [1], rule="balanced")  # elements 6..11
    boxes = layout.held_regions()
    assert boxes == [((1, 2), (2, 4)), ((2, 3), (0, 4))]
    assert sum(math.prod(b - a for a, b in box) for box in boxes) == 6


def test_refinement_keeps_only_what_the_receiver_holds():
    shape = (10,)
    receiver = TensorLayout.sharded(shape, 0, 2, [1])  # 5..10
    slices = refine(receiver, [TensorLayout.sharded(shape, 0, 3, [0, 1, 2])])  # cuts 4, 7
    assert slices == [((5, 7),), ((7, 10),)]


# --- link preference and load balance ---------------------------------------------------


def whole_state(n_tensors: int, numel: int) -> dict[str, TensorLayout]:
    return {f"t{i}": TensorLayout.whole((numel,)) for i in range(n_tensors)}


def test_a_local_holder_beats_a_remote_one_whatever_its_load():
    state = whole_state(6, 1000)
    remote = Holder(name="remote", host="h1", layouts=state)
    local = Holder(name="local", host="h0", layouts=state)
    receiver = Holder(name="r", host="h0", layouts=state)
    plan = plan_transfers([remote, local], [receiver], dict.fromkeys(state, 4))
    assert {t.source for t in plan.for_receiver("r")} == {"local"}
    assert {t.link for t in plan.for_receiver("r")} == {Link.LOCAL}


def test_intra_node_beats_inter_node():
    state = whole_state(3, 10)
    other_host = Holder(name="far", host="h1", device=0, layouts=state)
    same_host = Holder(name="near", host="h0", device=1, layouts=state)
    receiver = Holder(name="r", host="h0", device=0, layouts=state)
    plan = plan_transfers([other_host, same_host], [receiver], dict.fromkeys(state, 4))
    assert {(t.source, t.link) for t in plan.for_receiver("r")} == {("near", Link.INTRA_NODE)}


def test_equal_holders_share_the_load_by_accumulated_latency():
    # one big tensor then four quarter-sized ones: the big one goes to the first holder,
    # the other holder then takes small ones until its accumulated latency catches up
    state = {"t0": TensorLayout.whole((1000,))} | {
        f"t{i}": TensorLayout.whole((250,)) for i in range(1, 5)
    }
    a = Holder(name="a", host="h1", layouts=state)
    b = Holder(name="b", host="h1", layouts=state)
    receiver = Holder(name="r", host="h0", layouts=state)
    plan = plan_transfers([a, b], [receiver], dict.fromkeys(state, 4))
    sources = {t.tensor: t.source for t in plan.for_receiver("r")}
    assert sources == {"t0": "a", "t1": "b", "t2": "b", "t3": "b", "t4": "b"}
    assert plan.bytes_by_source() == {"a": 4000, "b": 4000}
    seconds = dict(plan.source_seconds)
    assert seconds["a"] == seconds["b"] == pytest.approx(plan.estimated_seconds)


def test_slices_of_one_tensor_alternate_between_equal_holders():
    shape = (8, 4)
    a = Holder(name="a", host="h1", layouts={"w": TensorLayout.whole(shape)})
    b = Holder(name="b", host="h1", layouts={"w": TensorLayout.whole(shape)})
    receiver = Holder(
        name="r", host="h0", layouts={"w": TensorLayout.sharded(shape, 0, 4, range(4))}
    )
    plan = plan_transfers([a, b], [receiver], {"w": 2})
    assert [t.source for t in plan.for_receiver("r")] == ["a", "b", "a", "b"]


def test_each_receiver_uses_its_own_local_holder():
    state = whole_state(4, 100)
    sources = [Holder(name=f"cpu{h}", host=f"h{h}", layouts=state) for h in range(2)]
    receivers = [Holder(name=f"gpu{h}", host=f"h{h}", device=0, layouts=state) for h in range(2)]
    plan = plan_transfers(sources, receivers, dict.fromkeys(state, 2))
    for h in range(2):
        assert {t.source for t in plan.for_receiver(f"gpu{h}")} == {f"cpu{h}"}


def test_latency_not_bytes_balances_the_load():
    # "a" sends 400 B over a slow remote link, "b" 800 B locally: by bytes "a" is the less
    # loaded, by estimated latency "b" is, and "b" gets the next remote demand
    state = {
        "a_small": TensorLayout.whole((100,)),
        "b_big": TensorLayout.whole((200,)),
        "c": TensorLayout.whole((10,)),
    }
    a = Holder(name="a", host="h0", layouts=state)
    b = Holder(name="b", host="h1", layouts=state)
    receivers = [
        Holder(name="r1", host="h2", layouts={"a_small": state["a_small"]}),
        Holder(name="r0", host="h1", layouts={"b_big": state["b_big"]}),
        Holder(name="r2", host="h3", layouts={"c": state["c"]}),
    ]
    links = LinkConfig(inter_node_gb_per_s=1.0, local_gb_per_s=100.0)
    plan = TransferPlanner(links).plan([a, b], receivers, dict.fromkeys(state, 4))
    assert [t.source for t in plan.for_receiver("r1")] == ["a"]
    assert [t.source for t in plan.for_receiver("r0")] == ["b"]
    assert [t.source for t in plan.for_receiver("r2")] == ["b"]


# --- cache ------------------------------------------------------------------------------


def test_identical_plans_come_from_the_cache():
    state = whole_state(2, 10)
    sources = [Holder(name="s", host="h0", layouts=state)]
    receivers = [Holder(name="r", host="h0", layouts=state)]
    planner = TransferPlanner()
    first = planner.plan(sources, receivers, dict.fromkeys(state, 4))
    again = planner.plan(
        [Holder(name="s", host="h0", layouts=dict(state))], receivers, dict.fromkeys(state, 4)
    )
    assert again is first
    assert (planner.hits, planner.misses) == (1, 1)
    moved = [Holder(name="r", host="h1", layouts=state)]  # another topology: another plan
    assert planner.plan(sources, moved, dict.fromkeys(state, 4)) is not first
    assert (planner.hits, planner.misses) == (1, 2)


def test_the_cache_evicts_the_least_recently_used_plan():
    state = whole_state(1, 10)
    planner = TransferPlanner(capacity=1)
    s = [Holder(name="s", host="h0", layouts=state)]
    r0, r1 = (
        [Holder(name="r", host="h0", layouts=state)],
        [Holder(name="r", host="h1", layouts=state)],
    )
    for receivers in (r0, r1, r0):
        planner.plan(s, receivers, {"t0": 4})
    assert (planner.hits, planner.misses) == (0, 3)


# --- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shape": (4,), "dim": 0, "mesh": 2, "indices": (2,)}, "shard index 2 out of range"),
        ({"shape": (4,), "dim": 0, "mesh": 2, "indices": (-1,)}, "shard index -1 out of range"),
        ({"shape": (4,), "dim": 1, "mesh": 2, "indices": (0,)}, "split dim must be in [0, 1)"),
        ({"shape": (4,), "dim": 0, "mesh": 0, "indices": (0,)}, "mesh must be >= 1"),
        ({"shape": (4,), "dim": 0, "mesh": 2, "indices": (1, 0)}, "strictly increasing"),
        ({"shape": (4,), "dim": 0, "mesh": 2, "indices": (1, 1)}, "strictly increasing"),
        ({"shape": (4,), "dim": 0, "mesh": 2, "indices": ()}, "at least one part"),
        ({"shape": (4,), "mesh": 2}, "whole (unsplit) layout"),
        ({"shape": (-1,)}, "negative"),
        ({"shape": (4,), "dim": 0, "mesh": 2, "rule": "round"}, "split rule"),
    ],
)
def test_bad_layouts_are_refused_with_a_reason(kwargs, message):
    with pytest.raises(LayoutError, match=re.escape(message)):
        TensorLayout(**kwargs)


def test_a_decoded_layout_is_validated_too():
    raw = {"shape": [4], "dim": 0, "mesh": 2, "indices": [5]}
    with pytest.raises(msgspec.ValidationError, match="out of range"):
        msgspec.convert(raw, TensorLayout)
    assert msgspec.convert(
        {"shape": [4], "dim": "flat", "mesh": 2, "indices": [1]}, TensorLayout
    ) == (TensorLayout(shape=(4,), dim=FLAT, mesh=2, indices=(1,)))


def test_shape_mismatch_is_named():
    s = Holder(name="store", host="h", layouts={"w": TensorLayout.whole((4, 8))})
    r = Holder(name="replica-0", host="h", layouts={"w": TensorLayout.whole((4, 9))})
    with pytest.raises(LayoutError, match=r"'w': shape mismatch: \(4, 8\) at 'store' but"):
        plan_transfers([s], [r], {"w": 4})


def test_missing_tensor_is_named():
    s = Holder(name="store", host="h", layouts={"w": TensorLayout.whole((4,))})
    r = Holder(name="r", host="h", layouts={"bias": TensorLayout.whole((4,))})
    with pytest.raises(LayoutError, match=r"'bias' needed by \['r'\] is held by no source"):
        plan_transfers([s], [r], {"w": 4, "bias": 4})


def test_a_region_no_source_holds_is_named():
    s = Holder(name="s", host="h", layouts={"w": TensorLayout.sharded((4,), 0, 2, [0])})
    r = Holder(name="r", host="h", layouts={"w": TensorLayout.whole((4,))})
    with pytest.raises(LayoutError, match=r"region \(\(2, 4\),\) needed by 'r'"):
        plan_transfers([s], [r], {"w": 4})


def test_duplicate_names_and_missing_itemsize_are_refused():
    w = {"w": TensorLayout.whole((4,))}
    with pytest.raises(LayoutError, match="two sources are named 's'"):
        plan_transfers([Holder(name="s", host="h", layouts=w)] * 2, [], {"w": 4})
    with pytest.raises(LayoutError, match="no positive itemsize"):
        plan_transfers(
            [Holder(name="s", host="h", layouts=w)], [Holder(name="r", host="h", layouts=w)], {}
        )


def test_link_bandwidths_load_from_toml_with_estimated_defaults():
    links = decode_toml("inter_node_gb_per_s = 25.0\n", LinkConfig, "gps.toml")
    assert links.inter_node_gb_per_s == 25.0
    assert links.local_gb_per_s == LinkConfig().local_gb_per_s
    with pytest.raises(ConfigError, match="gps.toml: key 'local_gb_per_s'"):
        decode_toml("local_gb_per_s = 0.0\n", LinkConfig, "gps.toml")
