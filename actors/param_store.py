"""Host shared-memory parameter store: GPS on one host, with versions.

Owns the bytes of published parameter versions on this host and the copies in and out of
them. The trainer Writes a full or sharded state (named tensors + its layout) through a
transfer plan into a new version; each reader Reads into its own tensors, in its own
layout, through a transfer plan from the published version. Plans come from
``pivot.gps`` and are cached per writer / reader.

Publication protocol (why a reader never sees half a version):

* The header segment, named after the store, holds two int64 words: a magic number and
  the published (version, slot), packed as ``version << 16 | slot`` (-1: nothing yet,
  -2: store closed). One aligned 8-byte store publishes a version.
* Versions live in slot segments ``f"{store}-s{slot}"``: a preamble (magic, complete flag,
  version, manifest length), a msgpack manifest (tensor name -> dtype, shape, offset),
  then the tensors. Slots are recycled, so that a Write copies into pages that already
  exist instead of paying for fresh ones (on the build machine fresh pages cost ~7x the
  copy).
* Slots are guarded by ``flock``: the writer fills a slot only under an exclusive lock,
  and never locks the published one; a reader copies out of a slot only under a shared
  lock, after checking (under it) that the slot is complete and holds the version the
  header named. If not (the slot was recycled since it read the header), it reads the
  header again. So a reader that starts during a write gets the previous complete
  version, and a slot being read is never overwritten: the writer takes another slot, or
  a new one.
* A slot that no reader holds is kept as a spare (at most ``spare_slots``) or unlinked.
  Readers cache their mappings and drop those of unlinked slots at their next Read.

The writer registers its segments with multiprocessing's resource tracker, so a writer
that dies does not leak /dev/shm; readers map segments directly (not through
``SharedMemory``) so that they never register, and so never unlink, what they do not own.

A store that must outlive its writer (a job's, whose trainer may die and be restarted) is
opened with ``adopt=True``: it belongs to the job that named it, not to the writer. The
writer takes over a store of that name that exists (its published version stays readable
all along, and is the next writer's starting point), registers nothing, and ``close()``
leaves the segments; the job removes them at its end (``remove_store``), and the next start
removes those of jobs that died (``remove_orphaned_stores``).
Linux only (flock on POSIX shared memory, MAP_POPULATE, the segments listed in /dev/shm).
"""

from __future__ import annotations

import _posixshmem
import contextlib
import fcntl
import mmap
import os
import platform
import secrets
import struct
import time
from collections.abc import Mapping, Sequence
from multiprocessing import resource_tracker

import msgspec
import numpy as np
import torch

from pivot.gps import Holder, LayoutError, LinkConfig, TensorLayout, Transfer, TransferPlanner

_MAGIC = int.from_bytes(b"PIVOTGPS", "little", signed=True)
_NOTHING = -1
_CLOSED = -2
_SLOT_BITS = 16
_HEADER_BYTES = 16
_PREAMBLE = struct.Struct("<qqqq")  # magic, complete (0/1), version, manifest length
_ALIGN = 64
_STORE_HOLDER = "store"
_SHM = "/dev/shm"
#: A job's store: this prefix and the pid of the job's process (``job_store_name``).
JOB_STORE_PREFIX = "pivot-gps-"

#: A writer's shard: its tensors and their layouts (None: every tensor whole).
Shard = tuple[Mapping[str, torch.Tensor], Mapping[str, TensorLayout] | None]


class StoreError(RuntimeError):
    """The store cannot do what was asked; the message says why."""


class StoreClosed(StoreError):
    """The writer closed the store."""


class NoVersion(StoreError):
    """Nothing has been written to the store yet."""


class TensorEntry(msgspec.Struct, frozen=True, array_like=True):
    dtype: str
    shape: tuple[int, ...]
    offset: int


def job_store_name(pid: int | None = None) -> str:
    """The name of the store of the job whose process is ``pid`` (default this one)."""
    return f"{JOB_STORE_PREFIX}{pid if pid is not None else os.getpid()}"


def _segments_of(store: str) -> list[str]:
    """The names of a store's segments in /dev/shm: its header and its slots."""
    try:
        names = os.listdir(_SHM)
    except FileNotFoundError:
        return []
    return [n for n in names if n == store or n.startswith(f"{store}-s")]


def remove_store(store: str) -> None:
    """Unlink every segment of ``store`` (readers that map one keep their mapping)."""
    for name in _segments_of(store):
        with contextlib.suppress(FileNotFoundError):
            _posixshmem.shm_unlink("/" + name)


def remove_orphaned_stores() -> list[str]:
    """Remove the job stores (``job_store_name``) of this user whose job process is dead;
    the names removed."""
    from pivot.bus.sockets import owner_alive

    removed = []
    uid = os.getuid()
    try:
        names = os.listdir(_SHM)
    except FileNotFoundError:
        return []
    for name in names:
        pid = name[len(JOB_STORE_PREFIX) :]
        if not name.startswith(JOB_STORE_PREFIX) or not pid.isdigit():
            continue  # another's, or a slot (removed with its header)
        try:
            if os.stat(os.path.join(_SHM, name)).st_uid != uid:
                continue
        except FileNotFoundError:
            continue
        if not owner_alive(pid):
            remove_store(name)
            removed.append(name)
    return removed


def slot_name(store: str, slot: int) -> str:
    return f"{store}-s{slot}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise StoreError(f"unknown dtype {name!r} in a slot manifest")
    return dtype


def _device_index(tensors: Mapping[str, torch.Tensor]) -> int | None:
    for t in tensors.values():
        return None if t.device.type == "cpu" else (t.device.index or 0)
    return None


class _Segment:
    """One mapped shared-memory segment and the fd that carries its flock."""

    def __init__(self, name: str, size: int | None = None, *, track: bool = True) -> None:
        """Create the segment when ``size`` is given (and, with ``track``, register it with
        the resource tracker), else open an existing one."""
        self.name = name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0)
        self.fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if size is not None:
                os.ftruncate(self.fd, size)
            self.size = os.fstat(self.fd).st_size
            # populate: one kernel call maps every page instead of a fault per page
            self.map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(self.fd)
            if size is not None:
                _posixshmem.shm_unlink("/" + name)
            raise
        self.owned = size is not None and track
        if self.owned:
            resource_tracker.register("/" + name, "shared_memory")
        self.views: dict[str, torch.Tensor] = {}
        self.schema: bytes | None = None  # the manifest the views were built from

    def try_lock(self, shared: bool) -> bool:
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def unlinked(self) -> bool:
        return os.fstat(self.fd).st_nlink == 0

    def tensor_views(self, manifest: bytes) -> dict[str, torch.Tensor]:
        """Views of the tensors ``manifest`` places in this segment (cached per schema)."""
        if manifest != self.schema:
            self.views = {}
            entries = msgspec.msgpack.decode(manifest, type=dict[str, TensorEntry])
            for name, e in entries.items():
                dtype = _dtype(e.dtype)
                numel = int(np.prod(e.shape, dtype=np.int64))
                if numel == 0:
                    self.views[name] = torch.empty(e.shape, dtype=dtype)
                else:
                    flat = torch.frombuffer(self.map, dtype=dtype, count=numel, offset=e.offset)
                    self.views[name] = flat.view(e.shape)
            self.schema = manifest
        return self.views

    def close(self) -> None:
        self.views = {}  # no view may outlive the mapping
        self.map.close()
        os.close(self.fd)

    def unlink(self) -> None:
        self.close()
        try:
            _posixshmem.shm_unlink("/" + self.name)
        except FileNotFoundError:
            pass
        if self.owned:
            resource_tracker.unregister("/" + self.name, "shared_memory")


def _run(
    transfers: Sequence[Transfer],
    sources: Mapping[str, Mapping[str, torch.Tensor]],
    into: Mapping[str, torch.Tensor],
) -> None:
    """Execute one receiver's transfers. Slice views are dropped even when a copy fails: a
    view into shared memory kept alive by a traceback would keep its mapping from closing."""
    src = dst = None
    try:
        with torch.no_grad():
            for t in transfers:
                src = t.source_access.view(sources[t.source][t.tensor])
                dst = t.receiver_access.view(into[t.tensor])
                dst.copy_(src)
    finally:
        src = dst = None


def _check_tensors(
    tensors: Mapping[str, torch.Tensor], layouts: Mapping[str, TensorLayout], who: str
) -> None:
    if set(tensors) != set(layouts):
        missing = sorted(set(layouts) - set(tensors))
        extra = sorted(set(tensors) - set(layouts))
        raise LayoutError(
            f"{who}: tensors and layouts name different tensors "
            f"(layout without tensor: {missing}, tensor without layout: {extra})"
        )
    for name, layout in layouts.items():
        t = tensors[name]
        if tuple(t.shape) != layout.local_shape():
            raise LayoutError(
                f"{who}: tensor {name!r} has shape {tuple(t.shape)}, "
                f"but its layout {layout} holds {layout.local_shape()}"
            )
        if layout.dim == "flat" and not t.is_contiguous():
            raise LayoutError(f"{who}: tensor {name!r} has a flat layout and must be contiguous")


def _whole(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorLayout]:
    return {name: TensorLayout.whole(tuple(t.shape)) for name, t in tensors.items()}


def _manifest(
    shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, torch.dtype]
) -> tuple[bytes, int]:
    """The manifest of a slot holding these tensors, and the slot's size in bytes."""
    # offsets depend on the manifest's size, which depends on the offsets: place the
    # tensors after the size the manifest has with the widest offsets
    widest = {n: TensorEntry(_dtype_name(dtypes[n]), s, 2**62) for n, s in shapes.items()}
    start = _PREAMBLE.size + len(msgspec.msgpack.encode(widest))
    offset = -(-start // _ALIGN) * _ALIGN
    entries = {}
    for name in sorted(shapes):
        entries[name] = TensorEntry(_dtype_name(dtypes[name]), shapes[name], offset)
        nbytes = int(np.prod(shapes[name], dtype=np.int64)) * dtypes[name].itemsize
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return msgspec.msgpack.encode(entries), max(offset, start)


class ParameterStore:
    """The writer's side of a host store. One writer per store; readers attach by name.

    ``name``: the shared-memory name (a fresh random one by default). ``host``: this host's
    name in plans. ``spare_slots``: free slots kept for reuse beyond the published one.
    Use as a context manager, or call ``close()``: it unlinks every segment, but with
    ``adopt`` (a job's store, see the module docstring), which takes over a store of that
    name and whose ``close()`` leaves every segment for the next writer.
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        host: str | None = None,
        links: LinkConfig | None = None,
        spare_slots: int = 1,
        adopt: bool = False,
    ) -> None:
        self.name = name or f"pivot-gps-{secrets.token_hex(6)}"
        self.host = host or platform.node()
        self.planner = TransferPlanner(links)
        self.spare_slots = spare_slots
        self.adopted = adopt
        self._slots: dict[int, _Segment] = {}
        self._next_slot = 0
        self._version: int | None = None
        self._published_slot: int | None = None
        self._closed = False
        try:
            self._header = _Segment(self.name, _HEADER_BYTES, track=not adopt)
        except FileExistsError:
            if not adopt:
                raise StoreError(
                    f"a shared-memory segment named {self.name!r} exists already (another "
                    f"store, or one left by a writer that crashed: remove /dev/shm/{self.name})"
                ) from None
            self._take_over()
            return
        self._words = np.ndarray((2,), dtype=np.int64, buffer=self._header.map)
        self._words[1] = _NOTHING
        self._words[0] = _MAGIC

    def _take_over(self) -> None:
        """Become the writer of the existing store (``adopt``): its published version, its
        slots (a slot the last writer left half-filled is a spare like any other)."""
        self._header = _Segment(self.name)
        self._words = np.ndarray((2,), dtype=np.int64, buffer=self._header.map)
        if self._header.size < _HEADER_BYTES or self._words[0] != _MAGIC:
            self._header.close()
            raise StoreError(f"shared-memory segment {self.name!r} is not a parameter store")
        for segment in _segments_of(self.name):
            suffix = segment[len(self.name) + 2 :]
            if segment != self.name and suffix.isdigit():
                with contextlib.suppress(FileNotFoundError):  # trimmed meanwhile
                    self._slots[int(suffix)] = _Segment(segment)
        self._next_slot = max(self._slots, default=-1) + 1
        word = int(self._words[1])
        if word == _CLOSED:
            self._words[1] = _NOTHING
        elif word != _NOTHING:
            self._version, self._published_slot = word >> _SLOT_BITS, word & (2**_SLOT_BITS - 1)

    @property
    def version(self) -> int | None:
        """The published version, None before the first Write."""
        return self._version

    @property
    def slots(self) -> int:
        """How many slot segments exist now (published, spare, or held by readers)."""
        return len(self._slots)

    def write(
        self,
        tensors: Mapping[str, torch.Tensor],
        layouts: Mapping[str, TensorLayout] | None = None,
        *,
        version: int | None = None,
    ) -> int:
        """Write one holder's state (whole tensors by default) as a new version."""
        return self.write_shards([(tensors, layouts)], version=version)

    def write_shards(self, shards: Sequence[Shard], *, version: int | None = None) -> int:
        """Write the union of several shards (e.g. every trainer rank's) as one new version.

        Every element of every named tensor must be held by some shard. ``version``
        defaults to the published one + 1 and must exceed it. Returns the version.
        """
        if self._closed:
            raise StoreClosed(f"store {self.name!r} is closed")
        if not shards:
            raise LayoutError("write: no shards given")
        new = (self._version or 0) + 1 if version is None else version
        if self._version is not None and new <= self._version:
            raise StoreError(
                f"versions must increase: published {self._version}, asked to write {new}"
            )
        if not 0 <= new < 2 ** (63 - _SLOT_BITS):
            raise StoreError(f"versions must be in [0, 2**47), found {new}")

        sources, buffers = [], {}
        dtypes: dict[str, torch.dtype] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for i, (tensors, layouts) in enumerate(shards):
            who = f"shard{i}"
            layouts = _whole(tensors) if layouts is None else layouts
            _check_tensors(tensors, layouts, who)
            for name, t in tensors.items():
                if dtypes.setdefault(name, t.dtype) != t.dtype:
                    raise LayoutError(
                        f"tensor {name!r}: dtype {t.dtype} in {who}, "
                        f"but {dtypes[name]} in an earlier shard"
                    )
                shapes.setdefault(name, layouts[name].shape)
            device = _device_index(tensors)
            sources.append(Holder(name=who, host=self.host, device=device, layouts=dict(layouts)))
            buffers[who] = tensors
        store = Holder(
            name=_STORE_HOLDER,
            host=self.host,
            layouts={n: TensorLayout.whole(s) for n, s in shapes.items()},
        )
        itemsize = {n: d.itemsize for n, d in dtypes.items()}
        plan = self.planner.plan(sources, [store], itemsize)

        manifest, size = _manifest(shapes, dtypes)
        slot_id, slot = self._free_slot(size)
        try:
            _PREAMBLE.pack_into(slot.map, 0, _MAGIC, 0, new, len(manifest))
            slot.map[_PREAMBLE.size : _PREAMBLE.size + len(manifest)] = manifest
            self._fill(slot, manifest, plan.for_receiver(_STORE_HOLDER), buffers)
            _PREAMBLE.pack_into(slot.map, 0, _MAGIC, 1, new, len(manifest))
        finally:
            slot.unlock()
        # the publication point: before it readers get the previous version, after it this one
        self._words[1] = new << _SLOT_BITS | slot_id
        self._version, self._published_slot = new, slot_id
        self._trim()
        return new

    def _free_slot(self, size: int) -> tuple[int, _Segment]:
        """A slot of at least ``size`` bytes, locked exclusively: a spare no reader holds,
        or a new one."""
        for slot_id, slot in sorted(self._slots.items()):
            if slot_id == self._published_slot or not slot.try_lock(shared=False):
                continue
            if slot.size >= size:
                return slot_id, slot
            slot.unlink()  # too small for this schema, and nobody reads it
            del self._slots[slot_id]
        if self._next_slot >= 2**_SLOT_BITS:
            raise StoreError(f"store {self.name!r} ran out of slot ids")
        slot_id, self._next_slot = self._next_slot, self._next_slot + 1
        slot = _Segment(slot_name(self.name, slot_id), size, track=not self.adopted)
        slot.try_lock(shared=False)
        self._slots[slot_id] = slot
        return slot_id, slot

    def _fill(
        self,
        slot: _Segment,
        manifest: bytes,
        transfers: Sequence[Transfer],
        buffers: Mapping[str, Mapping[str, torch.Tensor]],
    ) -> None:
        _run(transfers, buffers, slot.tensor_views(manifest))

    def _trim(self) -> None:
        """Unlink free slots beyond the spares; slots that readers hold stay."""
        spares = 0
        for slot_id, slot in sorted(self._slots.items()):
            if slot_id == self._published_slot or not slot.try_lock(shared=False):
                continue
            spares += 1
            if spares > self.spare_slots:
                slot.unlink()  # still locked: no reader can start on it meanwhile
                del self._slots[slot_id]
            else:
                slot.unlock()

    def close(self) -> None:
        """Mark the store closed for readers and unlink every segment it owns; an adopted
        store's segments stay as they are (the published version readable), only unmapped
        here."""
        if self._closed:
            return
        self._closed = True
        if self.adopted:
            del self._words
            for slot in self._slots.values():
                slot.close()
            self._slots.clear()
            self._header.close()
            return
        self._words[1] = _CLOSED
        del self._words
        for slot in self._slots.values():
            slot.unlink()
        self._slots.clear()
        self._header.unlink()

    def __enter__(self) -> ParameterStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ParameterReader:
    """A reader of a host store, attached by name (from any process on this host).

    ``name``: this receiver's name in plans. ``host``: this host's name in plans (must match
    the writer's for link classes to say "same host"; defaults to the node name).
    """

    def __init__(
        self,
        store: str,
        *,
        name: str = "reader",
        host: str | None = None,
        links: LinkConfig | None = None,
        max_attempts: int = 1000,
    ) -> None:
        self.store = store
        self.name = name
        self.host = host or platform.node()
        self.planner = TransferPlanner(links)
        self.max_attempts = max_attempts
        try:
            self._header: _Segment | None = _Segment(store)
        except FileNotFoundError:
            raise StoreError(f"no parameter store named {store!r} on this host") from None
        self._slots: dict[int, _Segment] = {}
        self._sources: dict[bytes, Holder] = {}  # the store as a plan source, per schema
        if self._header.size < _HEADER_BYTES:
            self._header.close()
            raise StoreError(f"shared-memory segment {store!r} is not a parameter store")
        self._words = np.ndarray((2,), dtype=np.int64, buffer=self._header.map)
        if self._words[0] != _MAGIC:
            self.close()
            raise StoreError(f"shared-memory segment {store!r} is not a parameter store")

    def _published(self) -> tuple[int, int] | None:
        if self._header is None:
            raise StoreError("this reader is closed")
        word = int(self._words[1])
        if word == _CLOSED:
            raise StoreClosed(f"store {self.store!r} is closed")
        if word == _NOTHING:
            return None
        return word >> _SLOT_BITS, word & (2**_SLOT_BITS - 1)

    def published_version(self) -> int | None:
        """The version a Read would get now (None before the first Write)."""
        published = self._published()
        return None if published is None else published[0]

    def _slot(self, slot_id: int) -> _Segment | None:
        slot = self._slots.get(slot_id)
        if slot is None:
            try:
                slot = _Segment(slot_name(self.store, slot_id))
            except FileNotFoundError:
                return None  # trimmed after a newer version was published
            self._slots[slot_id] = slot
        return slot

    def read(
        self,
        into: Mapping[str, torch.Tensor],
        layouts: Mapping[str, TensorLayout] | None = None,
    ) -> int:
        """Copy the newest published version into ``into`` (laid out as ``layouts``; whole
        tensors by default) and return its version. Tensors may be a subset of the store's,
        on any device, and of another dtype (values are cast as ``Tensor.copy_`` does)."""
        layouts = _whole(into) if layouts is None else layouts
        _check_tensors(into, layouts, self.name)
        for attempt in range(self.max_attempts):
            published = self._published()
            if published is None:
                raise NoVersion(f"store {self.store!r} has no version yet")
            version, slot_id = published
            slot = self._slot(slot_id)
            if slot is not None and slot.try_lock(shared=True):
                try:
                    magic, complete, held, length = _PREAMBLE.unpack_from(slot.map, 0)
                    if magic == _MAGIC and complete and held == version:
                        start = _PREAMBLE.size
                        self._copy(slot, bytes(slot.map[start : start + length]), into, layouts)
                        self._drop_unlinked(keep=slot_id)
                        return version
                finally:
                    slot.unlock()
            if attempt:
                time.sleep(0)  # the writer is between steps: let it run
        raise StoreError(
            f"store {self.store!r}: versions replaced each other {self.max_attempts} times "
            "before this reader could hold one"
        )

    def _copy(
        self,
        slot: _Segment,
        manifest: bytes,
        into: Mapping[str, torch.Tensor],
        layouts: Mapping[str, TensorLayout],
    ) -> None:
        views = slot.tensor_views(manifest)
        source = self._sources.get(manifest)
        if source is None:
            whole = {n: TensorLayout.whole(tuple(v.shape)) for n, v in views.items()}
            source = Holder(name=_STORE_HOLDER, host=self.host, layouts=whole)
            self._sources = {manifest: source}  # schemas rarely change: keep the latest
        receiver = Holder(
            name=self.name, host=self.host, device=_device_index(into), layouts=dict(layouts)
        )
        itemsize = {n: v.element_size() for n, v in views.items() if n in layouts}
        plan = self.planner.plan([source], [receiver], itemsize)
        _run(plan.for_receiver(self.name), {_STORE_HOLDER: views}, into)

    def _drop_unlinked(self, keep: int) -> None:
        # a mapping of a slot the writer unlinked would keep its memory alive
        for slot_id in [s for s in self._slots if s != keep]:
            if self._slots[slot_id].unlinked():
                self._slots.pop(slot_id).close()

    def release(self) -> None:
        """Unmap every cached slot (the next Read maps again)."""
        for slot in self._slots.values():
            slot.close()
        self._slots.clear()

    def close(self) -> None:
        if self._header is None:
            return
        self.release()
        del self._words
        self._header.close()
        self._header = None

    def __enter__(self) -> ParameterReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
