"""`pivot bench gps`: Write a ~50 MB state from two ZeRO-style flat shards into the host
store, then Read it whole and as one TP=4 rank. Prints GB/s of bytes copied.
"""

from __future__ import annotations

import time

import torch

from pivot.actors.param_store import ParameterReader, ParameterStore
from pivot.gps import TensorLayout


def toy_state(layers: int = 4, hidden: int = 512, mlp: int = 2048) -> dict[str, torch.Tensor]:
    state = {}
    for i in range(layers):
        state[f"l{i}.qkv"] = torch.randn(3 * hidden, hidden)
        state[f"l{i}.o"] = torch.randn(hidden, hidden)
        state[f"l{i}.up"] = torch.randn(mlp, hidden)
        state[f"l{i}.down"] = torch.randn(hidden, mlp)
    return state


def tp_layouts(state: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, TensorLayout]:
    # column-parallel qkv/up split the output dim, row-parallel o/down the input dim
    return {
        n: TensorLayout.sharded(t.shape, 0 if n.endswith(("qkv", "up")) else 1, tp, rank)
        for n, t in state.items()
    }


def zero_shards(state: dict[str, torch.Tensor], world: int):
    shards = []
    for rank in range(world):
        layouts = {n: TensorLayout.flat_range(t.shape, world, rank) for n, t in state.items()}
        tensors = {n: torch.chunk(t.reshape(-1), world)[rank].clone() for n, t in state.items()}
        shards.append((tensors, layouts))
    return shards


def timed(fn, repeat: int) -> tuple[float, float]:
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return first, (time.perf_counter() - start) / repeat


def main(threads: int | None = None, repeat: int = 10) -> None:
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    state = toy_state()
    total = sum(t.numel() * t.element_size() for t in state.values())
    shards = zero_shards(state, 2)
    tp = tp_layouts(state, 4, 1)
    tp_into = {n: torch.empty(lay.local_shape()) for n, lay in tp.items()}
    whole_into = {n: torch.empty_like(t) for n, t in state.items()}
    tp_bytes = sum(t.numel() * t.element_size() for t in tp_into.values())
    print(f"state {total / 1e6:.1f} MB in {len(state)} tensors, torch threads {threads}")
    with ParameterStore() as store, ParameterReader(store.name) as reader:
        first, steady = timed(lambda: store.write_shards(shards), repeat)
        print(
            f"write 2 flat shards -> store: first {total / first / 1e9:.2f} GB/s, "
            f"then {total / steady / 1e9:.2f} GB/s ({steady * 1e3:.1f} ms)"
        )
        first, steady = timed(lambda: reader.read(whole_into), repeat)
        print(
            f"read whole: first {total / first / 1e9:.2f} GB/s, "
            f"then {total / steady / 1e9:.2f} GB/s ({steady * 1e3:.1f} ms)"
        )
        first, steady = timed(lambda: reader.read(tp_into, tp), repeat)
        print(
            f"read TP=4 rank 1 ({tp_bytes / 1e6:.1f} MB): first {tp_bytes / first / 1e9:.2f} "
            f"GB/s, then {tp_bytes / steady / 1e9:.2f} GB/s ({steady * 1e3:.1f} ms)"
        )

        def new_version_then_read() -> None:
            store.write_shards(shards)
            reader.read(whole_into)

        _, steady = timed(new_version_then_read, repeat)
        start = time.perf_counter()
        for _ in range(repeat):
            store.write_shards(shards)
        write_only = (time.perf_counter() - start) / repeat
        read_new = steady - write_only
        print(
            f"read whole after each new version (recycled slots, cached mappings): "
            f"{total / read_new / 1e9:.2f} GB/s ({read_new * 1e3:.1f} ms)"
        )
        for name, want in state.items():
            assert torch.equal(whole_into[name], want), name
