"""GPS planning: how holders lay out tensors, and who sends which slice to whom.

This module owns the pure half of Global Parameter Storage (DESIGN.md, "GPS"):

* ``TensorLayout``: how one holder holds one tensor: whole, split along one dimension, or split
  as a flat (row-major) range the way ZeRO partitions a parameter; with the shard indices
  it holds.
* Refinement: the receiver's layout and every source's layout are cut to their common,
  coarsest, slices, so each atomic slice lies wholly inside one piece of every layout.
* Transfer planning: for each (slice, receiver) demand, the source is chosen by link class
  (local > intra-node > inter-node) and then by the smallest accumulated estimated latency
  (bytes / bandwidth of that link), so load spreads across sources; plans are cached.

Nothing here moves bytes. A plan tells its executor, for every transfer, where the slice
sits in the source's local buffer and in the receiver's (``Access``); executing it is the
holder's business (``pivot.actors.param_store`` does it on one host with shared memory).

Splitting rules. A dimension (or the flattened tensor) of size n split into ``mesh`` parts:

* ``"balanced"`` (default): torch.tensor_split / numpy.array_split semantics: exactly
  ``mesh`` parts, the first ``n % mesh`` one element longer. Parts are empty when mesh > n.
* ``"chunk"``: torch.chunk semantics, which is also how ZeRO-3 partitions a flattened
  parameter: parts of ceil(n / mesh) elements, the last ones shorter or empty.

Mesh sizes need not divide n; holding an empty part is allowed (it transfers nothing).

Refinement of two layouts split along different dimensions gives their product grid
(mesh 2 on dim 0 with mesh 3 on dim 1: six slices). A flat layout is first cut into the
few row-major-contiguous boxes each of its ranges covers, so slices stay boxes
(hyper-rectangles) and every copy is one strided tensor copy.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from enum import IntEnum
from typing import Any, Final, Literal

import msgspec

from pivot.config import ConfigStruct, PositiveFloat

#: A box of a tensor: one (start, stop) pair per dimension, in the coordinates it names.
Region = tuple[tuple[int, int], ...]

FLAT: Final = "flat"
SplitRule = Literal["balanced", "chunk"]


class LayoutError(ValueError):
    """A layout, or a set of layouts, that cannot be planned; the message says why."""


def part_bounds(n: int, mesh: int, rule: SplitRule = "balanced") -> tuple[int, ...]:
    """The ``mesh + 1`` boundaries of ``n`` elements split into ``mesh`` parts by ``rule``."""
    if mesh < 1:
        raise LayoutError(f"mesh must be >= 1, found {mesh}")
    if rule == "balanced":
        q, r = divmod(n, mesh)
        bounds = [0]
        for i in range(mesh):
            bounds.append(bounds[-1] + q + (1 if i < r else 0))
        return tuple(bounds)
    if rule == "chunk":
        size = -(-n // mesh)
        return tuple(min(i * size, n) for i in range(mesh + 1))
    raise LayoutError(f"split rule must be 'balanced' or 'chunk', found {rule!r}")


def _numel(region: Region) -> int:
    return math.prod(b - a for a, b in region)


def _extents(region: Region) -> tuple[int, ...]:
    return tuple(b - a for a, b in region)


def _full(shape: tuple[int, ...]) -> Region:
    return tuple((0, s) for s in shape)


def _intersect(a: Region, b: Region) -> Region | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def _contains(outer: Region, inner: Region) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner, strict=True))


def _flat_index(point: Sequence[int], shape: tuple[int, ...]) -> int:
    k = 0
    for p, s in zip(point, shape, strict=True):
        k = k * s + p
    return k


def _flat_boxes(start: int, stop: int, shape: tuple[int, ...]) -> list[Region]:
    """Cut the row-major range [start, stop) into boxes, each contiguous in memory."""
    if start >= stop:
        return []
    if not shape:
        return [()]
    inner = math.prod(shape[1:])
    rest = shape[1:]
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    if r0 == r1:  # within one row
        return [((r0, r0 + 1), *box) for box in _flat_boxes(c0, c1, rest)]
    boxes: list[Region] = []
    if c0:
        boxes += [((r0, r0 + 1), *box) for box in _flat_boxes(c0, inner, rest)]
        r0 += 1
    if r1 > r0:
        boxes.append(((r0, r1), *_full(rest)))
    if c1:
        boxes += [((r1, r1 + 1), *box) for box in _flat_boxes(0, c1, rest)]
    return boxes


class Access(msgspec.Struct, frozen=True, kw_only=True):
    """Where a slice sits in a holder's local buffer.

    For flat layouts the 1-D local buffer's element range ``flat`` is first viewed with
    ``shape``; ``index`` is then a box in that view (else a box in the local buffer itself).
    """

    index: Region
    flat: tuple[int, int] | None = None
    shape: tuple[int, ...] | None = None

    def view(self, buffer: Any) -> Any:
        """The slice of ``buffer`` (a torch tensor or numpy array), as a view that can be
        written through; flat layouts need a contiguous buffer."""
        if self.flat is not None:
            buffer = buffer[self.flat[0] : self.flat[1]].reshape(self.shape)
        if not self.index:
            return buffer[...]
        return buffer[tuple(slice(a, b) for a, b in self.index)]


class TensorLayout(msgspec.Struct, frozen=True, kw_only=True):
    """How one holder holds one tensor of shape ``shape``.

    ``dim``: ``None`` (the whole tensor), a dimension index (split along it), or ``"flat"``
    (the row-major flattened tensor is split). ``mesh``: number of parts; ``indices``: the
    parts held, strictly increasing. The holder's local buffer concatenates its parts in
    index order: along ``dim`` for a dimension split, as one 1-D tensor for ``"flat"``.
    ``rule``: how parts are sized (module docstring); it defaults to ``"balanced"`` here,
    but to ``"chunk"`` (ZeRO's) in ``TensorLayout.flat_range``.
    """

    shape: tuple[int, ...]
    dim: int | Literal["flat"] | None = None
    mesh: int = 1
    indices: tuple[int, ...] = (0,)
    rule: SplitRule = "balanced"

    def __post_init__(self) -> None:
        if any(s < 0 for s in self.shape):
            raise LayoutError(f"shape must have no negative sizes, found {self.shape}")
        if self.dim is None:
            if self.mesh != 1 or self.indices != (0,):
                raise LayoutError(
                    "a whole (unsplit) layout has mesh 1 and indices (0,), "
                    f"found mesh {self.mesh}, indices {self.indices}"
                )
            return
        if isinstance(self.dim, int) and not 0 <= self.dim < len(self.shape):
            raise LayoutError(
                f"split dim must be in [0, {len(self.shape)}) for shape {self.shape}, "
                f"found {self.dim}"
            )
        if self.mesh < 1:
            raise LayoutError(f"mesh must be >= 1, found {self.mesh}")
        if not self.indices:
            raise LayoutError("indices must name at least one part (omit the tensor instead)")
        bad = [i for i in self.indices if not 0 <= i < self.mesh]
        if bad:
            raise LayoutError(
                f"shard index {bad[0]} out of range for mesh {self.mesh} (indices {self.indices})"
            )
        if any(a >= b for a, b in zip(self.indices, self.indices[1:], strict=False)):
            raise LayoutError(f"indices must be strictly increasing, found {self.indices}")
        if self.rule not in ("balanced", "chunk"):
            raise LayoutError(f"split rule must be 'balanced' or 'chunk', found {self.rule!r}")

    # --- constructors -------------------------------------------------------------------

    @classmethod
    def whole(cls, shape: Sequence[int]) -> TensorLayout:
        return cls(shape=tuple(shape))

    @classmethod
    def sharded(
        cls,
        shape: Sequence[int],
        dim: int,
        mesh: int,
        indices: int | Sequence[int],
        rule: SplitRule = "balanced",
    ) -> TensorLayout:
        idx = (indices,) if isinstance(indices, int) else tuple(indices)
        return cls(shape=tuple(shape), dim=dim, mesh=mesh, indices=idx, rule=rule)

    @classmethod
    def flat_range(
        cls,
        shape: Sequence[int],
        mesh: int,
        indices: int | Sequence[int],
        rule: SplitRule = "chunk",
    ) -> TensorLayout:
        """A ZeRO-style flat partition; ``rule`` defaults to ZeRO-3's (torch.chunk)."""
        idx = (indices,) if isinstance(indices, int) else tuple(indices)
        return cls(shape=tuple(shape), dim=FLAT, mesh=mesh, indices=idx, rule=rule)

    # --- geometry -----------------------------------------------------------------------

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def bounds(self) -> tuple[int, ...]:
        """Part boundaries along the split dimension (or the flattened tensor)."""
        if self.dim is None:
            return (0, self.numel)
        n = self.numel if self.dim == FLAT else self.shape[self.dim]
        return part_bounds(n, self.mesh, self.rule)

    def _local_offsets(self) -> dict[int, int]:
        bounds = self.bounds()
        offsets, off = {}, 0
        for i in self.indices:
            offsets[i] = off
            off += bounds[i + 1] - bounds[i]
        return offsets

    def local_shape(self) -> tuple[int, ...]:
        """Shape of the holder's local buffer for this tensor."""
        if self.dim is None:
            return self.shape
        bounds = self.bounds()
        held = sum(bounds[i + 1] - bounds[i] for i in self.indices)
        if self.dim == FLAT:
            return (held,)
        return self.shape[: self.dim] + (held,) + self.shape[self.dim + 1 :]

    def _part_boxes(self, part: int) -> list[Region]:
        bounds = self.bounds()
        lo, hi = bounds[part], bounds[part + 1]
        if self.dim == FLAT:
            return _flat_boxes(lo, hi, self.shape)
        full = _full(self.shape)
        if self.dim is None:
            return [full] if self.numel else []
        box = full[: self.dim] + ((lo, hi),) + full[self.dim + 1 :]
        return [box] if _numel(box) else []

    def held_regions(self) -> list[Region]:
        """The non-empty boxes this holder holds, in global coordinates."""
        return [box for i in self.indices for box in self._part_boxes(i)]

    def cut(self, regions: Iterable[Region]) -> list[Region]:
        """Cut each region at this layout's part boundaries (whatever the holder holds)."""
        regions = list(regions)
        if self.dim is None:
            return regions
        if self.dim == FLAT:
            boxes = [b for part in range(self.mesh) for b in self._part_boxes(part)]
            return [
                r
                for region in regions
                for box in boxes
                if (r := _intersect(region, box)) is not None
            ]
        d, bounds = self.dim, self.bounds()
        out = []
        for region in regions:
            lo, hi = region[d]
            cuts = [lo] + [b for b in bounds if lo < b < hi] + [hi]
            out += [
                region[:d] + ((a, b),) + region[d + 1 :]
                for a, b in zip(cuts, cuts[1:], strict=False)
            ]
        return out

    def locate(self, region: Region) -> Access | None:
        """Where ``region`` (a non-empty box inside one of this layout's parts, as produced
        by refinement) sits in the local buffer; None when the holder does not hold it."""
        if self.dim is None:
            return Access(index=region)
        start = tuple(a for a, _ in region)
        bounds = self.bounds()
        if self.dim == FLAT:
            k = _flat_index(start, self.shape)
            part = bisect.bisect_right(bounds, k) - 1
            if part not in self.indices:
                return None
            base = self._local_offsets()[part] - bounds[part]
            for box in self._part_boxes(part):
                if _contains(box, region):
                    lo = base + _flat_index(tuple(a for a, _ in box), self.shape)
                    index = tuple(
                        (a - b0, b - b0) for (a, b), (b0, _) in zip(region, box, strict=True)
                    )
                    return Access(index=index, flat=(lo, lo + _numel(box)), shape=_extents(box))
            raise LayoutError(f"region {region} straddles flat pieces of {self}")
        d = self.dim
        part = bisect.bisect_right(bounds, start[d]) - 1
        if part not in self.indices:
            return None
        if region[d][1] > bounds[part + 1]:
            raise LayoutError(f"region {region} straddles parts of {self}")
        shift = self._local_offsets()[part] - bounds[part]
        a, b = region[d]
        return Access(index=region[:d] + ((a + shift, b + shift),) + region[d + 1 :])


def refine(needed: TensorLayout, sources: Iterable[TensorLayout]) -> list[Region]:
    """The atomic slices of what ``needed`` holds, cut at every source layout's parts.

    Each slice lies inside one piece of ``needed`` and inside one part (one contiguous box,
    for flat layouts) of every source layout, so it is either wholly held by a source or
    not at all. Equal partitions are cut once.
    """
    regions = needed.held_regions()
    seen: set[tuple[Any, ...]] = set()
    for layout in sources:
        if layout.shape != needed.shape:
            raise LayoutError(f"shape mismatch: {layout.shape} vs {needed.shape}")
        partition = (layout.dim, layout.mesh, layout.rule)
        if layout.dim is None or partition in seen:
            continue
        seen.add(partition)
        regions = layout.cut(regions)
    return regions


class Holder(msgspec.Struct, frozen=True, kw_only=True):
    """A party to a transfer: where it lives and how it lays out each tensor it holds
    (as a source) or wants (as a receiver). ``device`` None means host memory."""

    name: str
    host: str
    device: int | None = None
    layouts: dict[str, TensorLayout] = {}

    def key(self) -> tuple[Any, ...]:
        return (self.name, self.host, self.device, tuple(sorted(self.layouts.items())))


class Link(IntEnum):
    """Link classes, best first."""

    LOCAL = 0  # same host, same device (or both host memory): a memory copy
    INTRA_NODE = 1  # same host, different device: PCIe or NVLink
    INTER_NODE = 2  # different hosts: the network


def link_between(source: Holder, receiver: Holder) -> Link:
    if source.host != receiver.host:
        return Link.INTER_NODE
    return Link.LOCAL if source.device == receiver.device else Link.INTRA_NODE


class LinkConfig(ConfigStruct):
    """Bandwidth per link class, in GB/s (1e9 bytes/s). The defaults are estimates, not
    measurements: a host memory copy, PCIe 4.0 x16, a 100 Gb/s NIC. Only their ratios
    matter to the plan (they weigh one source's load against another's)."""

    local_gb_per_s: PositiveFloat = 50.0
    intra_node_gb_per_s: PositiveFloat = 25.0
    inter_node_gb_per_s: PositiveFloat = 12.5

    def seconds(self, nbytes: int, link: Link) -> float:
        gbps = (self.local_gb_per_s, self.intra_node_gb_per_s, self.inter_node_gb_per_s)[link]
        return nbytes / (gbps * 1e9)


class Transfer(msgspec.Struct, frozen=True, kw_only=True):
    """One slice of one tensor from one source to one receiver."""

    source: str
    tensor: str
    region: Region  # in global tensor coordinates
    nbytes: int
    link: Link
    source_access: Access
    receiver_access: Access


class ReceiverPlan(msgspec.Struct, frozen=True, kw_only=True):
    receiver: str
    transfers: tuple[Transfer, ...]


class TransferPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Per receiver, the transfers that fill its tensors; and each source's accumulated
    estimated seconds of sending."""

    receivers: tuple[ReceiverPlan, ...]
    source_seconds: tuple[tuple[str, float], ...]

    def for_receiver(self, name: str) -> tuple[Transfer, ...]:
        for plan in self.receivers:
            if plan.receiver == name:
                return plan.transfers
        raise KeyError(f"no receiver named {name!r} in this plan")

    def bytes_by_source(self) -> dict[str, int]:
        out: dict[str, int] = {name: 0 for name, _ in self.source_seconds}
        for plan in self.receivers:
            for t in plan.transfers:
                out[t.source] += t.nbytes
        return out

    @property
    def estimated_seconds(self) -> float:
        """Time of the busiest source, if sources send in parallel."""
        return max((s for _, s in self.source_seconds), default=0.0)


def _check_names(holders: Sequence[Holder], what: str) -> None:
    seen: set[str] = set()
    for h in holders:
        if h.name in seen:
            raise LayoutError(f"two {what} are named {h.name!r}")
        seen.add(h.name)


def plan_transfers(
    sources: Sequence[Holder],
    receivers: Sequence[Holder],
    itemsize: Mapping[str, int],
    links: LinkConfig | None = None,
) -> TransferPlan:
    """Plan how ``receivers`` get every tensor in their layouts from ``sources``.

    Demands are swept tensor by tensor (sorted by name), receiver by receiver, slice by
    slice; each goes to the source with the best link to that receiver, and among those the
    smallest accumulated estimated latency; ties go to the source listed first.
    ``itemsize``: bytes per element of each tensor (as the sources store it).
    """
    links = links or LinkConfig()
    _check_names(sources, "sources")
    _check_names(receivers, "receivers")
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for h in (*sources, *receivers):
        for name, layout in h.layouts.items():
            known = shapes.setdefault(name, (layout.shape, h.name))
            if known[0] != layout.shape:
                raise LayoutError(
                    f"tensor {name!r}: shape mismatch: {known[0]} at {known[1]!r} "
                    f"but {layout.shape} at {h.name!r}"
                )
    accumulated = {s.name: 0.0 for s in sources}
    order = {s.name: i for i, s in enumerate(sources)}
    transfers: dict[str, list[Transfer]] = {r.name: [] for r in receivers}
    for tensor in sorted({n for r in receivers for n in r.layouts}):
        holders = [s for s in sources if tensor in s.layouts]
        if not holders:
            wanting = [r.name for r in receivers if tensor in r.layouts]
            raise LayoutError(f"tensor {tensor!r} needed by {wanting} is held by no source")
        if tensor not in itemsize or itemsize[tensor] <= 0:
            raise LayoutError(f"tensor {tensor!r}: no positive itemsize given")
        size = itemsize[tensor]
        for receiver in receivers:
            needed = receiver.layouts.get(tensor)
            if needed is None:
                continue
            for region in refine(needed, (h.layouts[tensor] for h in holders)):
                candidates = [
                    (h, access)
                    for h in holders
                    if (access := h.layouts[tensor].locate(region)) is not None
                ]
                if not candidates:
                    raise LayoutError(
                        f"tensor {tensor!r}: region {region} needed by {receiver.name!r} "
                        "is held by no source"
                    )
                holder, access = min(
                    candidates,
                    key=lambda c: (
                        link_between(c[0], receiver),
                        accumulated[c[0].name],
                        order[c[0].name],
                    ),
                )
                link = link_between(holder, receiver)
                nbytes = _numel(region) * size
                accumulated[holder.name] += links.seconds(nbytes, link)
                target = needed.locate(region)
                assert target is not None  # refinement starts from what the receiver holds
                transfers[receiver.name].append(
                    Transfer(
                        source=holder.name,
                        tensor=tensor,
                        region=region,
                        nbytes=nbytes,
                        link=link,
                        source_access=access,
                        receiver_access=target,
                    )
                )
    return TransferPlan(
        receivers=tuple(
            ReceiverPlan(receiver=r.name, transfers=tuple(transfers[r.name])) for r in receivers
        ),
        source_seconds=tuple(accumulated.items()),
    )


class TransferPlanner:
    """``plan_transfers`` with an LRU cache keyed by (layouts, topology, itemsizes).

    ``hits`` / ``misses`` count cache outcomes; a second identical Read reuses its plan.
    """

    def __init__(self, links: LinkConfig | None = None, capacity: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"plan cache capacity must be >= 1, found {capacity}")
        self.links = links or LinkConfig()
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._cache: OrderedDict[tuple[Any, ...], TransferPlan] = OrderedDict()

    def plan(
        self,
        sources: Sequence[Holder],
        receivers: Sequence[Holder],
        itemsize: Mapping[str, int],
    ) -> TransferPlan:
        key = (
            tuple(s.key() for s in sources),
            tuple(r.key() for r in receivers),
            tuple(sorted(itemsize.items())),
        )
        plan = self._cache.get(key)
        if plan is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return plan
        self.misses += 1
        plan = plan_transfers(sources, receivers, itemsize, self.links)
        self._cache[key] = plan
        if len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return plan
