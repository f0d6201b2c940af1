"""`pivot bench trainer`: the DeepSpeed trainer group on its own, once per world size: startup,
training step (the step itself and the whole request), GPS write, offload and reload; medians
in milliseconds, on a batch shaped like the tiny job's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pivot.cli.flags import positive

if TYPE_CHECKING:  # torch and DeepSpeed load only when a bench runs
    from pivot.grpo import RolloutSample, TrainingSettings


def bench_samples(
    prompts: int = 16, samples_per_prompt: int = 4, seed: int = 0
) -> list[RolloutSample]:
    """A batch shaped like the tiny job's: task prompts, worked responses (~30 tokens with the
    prompt), one rewarded sample per prompt."""
    from pivot import task
    from pivot.engines.tokenizer import TextCodec
    from pivot.grpo import RolloutSample

    codec = TextCodec.char()
    out = []
    for g, problem in enumerate(task.make_problems(seed, prompts)):
        prompt = codec.encode(problem.prompt)
        response = codec.encode(task.worked_response(problem.prompt), bos=False) + [codec.eos_id]
        for j in range(samples_per_prompt):
            out.append(
                RolloutSample(
                    prompt_ids=prompt,
                    response_ids=response,
                    logprobs=[-1.0] * len(response),
                    reward=float(j == 0),
                    group=g,
                )
            )
    return out


async def bench(
    checkpoint: str | Path,
    run_dir: str | Path,
    *,
    world_size: int,
    steps: int = 10,
    settings: TrainingSettings | None = None,
) -> dict[str, Any]:
    """Start a trainer group of ``world_size`` ranks, time ``steps`` training steps, GPS
    writes, offload and reload; medians in milliseconds."""
    from pivot.actors.assembly import trainer_names
    from pivot.actors.param_store import remove_store
    from pivot.actors.trainer_deepspeed import add_trainer_group
    from pivot.actors.trainer_messages import OffloadTrainer, ReloadTrainer, TrainBatch
    from pivot.actors.vocabulary import rl_messages
    from pivot.bus import Actor, Bus, Directory, Supervisor, job_secret

    run = Path(run_dir)
    names = trainer_names("trainer", world_size)
    directory = Directory.ipc(run, [*names, "bench"])
    supervisor = Supervisor()
    started = time.perf_counter()
    store = f"pivot-bench-{uuid.uuid4().hex[:8]}"
    add_trainer_group(
        supervisor,
        "trainer",
        directory=directory,
        checkpoint=checkpoint,
        world_size=world_size,
        run_dir=run,
        store_name=store,
        settings=settings,
    )
    await supervisor.start()
    startup = time.perf_counter() - started
    # the ranks sign with the job's secret when one is set: the probe must too
    bus = Bus.nng(directory, rl_messages(), secret=job_secret())
    probe = Actor("bench", bus)
    await probe.start()
    samples = bench_samples()
    step_s, request_s, write_s, offload_s, reload_s = [], [], [], [], []
    try:
        for i in range(steps + 1):
            t = time.perf_counter()
            reply = await probe.request("trainer", TrainBatch(samples=samples, step=i), timeout=300)
            if i:  # the first step warms up
                request_s.append(time.perf_counter() - t)
                step_s.append(reply.stats.seconds)
                write_s.append(reply.gps_write_s)
        for _ in range(5):
            offload_s.append((await probe.request("trainer", OffloadTrainer(), timeout=60)).seconds)
            reload_s.append((await probe.request("trainer", ReloadTrainer(), timeout=60)).seconds)
    finally:
        await probe.stop()
        await bus.close()
        await supervisor.stop()
        remove_store(store)  # the trainer's store outlives its ranks (a job's GPS)

    def ms(values: list[float]) -> float:
        return round(1000 * statistics.median(values), 2)

    return {
        "world_size": world_size,
        "sequences": len(samples),
        "tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in samples),
        "startup_s": round(startup, 2),
        "train_step_ms": ms(step_s),
        "train_request_ms": ms(request_s),
        "gps_write_ms": ms(write_s),
        "offload_ms": ms(offload_s),
        "reload_ms": ms(reload_s),
    }


COLUMNS = (
    "world_size",
    "startup_s",
    "train_step_ms",
    "train_request_ms",
    "gps_write_ms",
    "offload_ms",
    "reload_ms",
)


def main(args: argparse.Namespace) -> int:
    from pivot.bus import configure_logging, run_real
    from pivot.grpo import TrainingSettings

    configure_logging("warning")  # stdout is the table (or the JSON lines)
    settings = TrainingSettings(zero_stage=args.zero_stage)
    if not args.json:
        print("  ".join(f"{c:>16s}" for c in COLUMNS), flush=True)
    for world_size in args.world_sizes:
        with tempfile.TemporaryDirectory(prefix="pivot-bench-") as run:
            result = run_real(
                bench(
                    args.checkpoint, run, world_size=world_size, steps=args.steps, settings=settings
                )
            )
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print("  ".join(f"{result[c]:>16}" for c in COLUMNS), flush=True)
    return 0


def add_parser(bench_sub) -> None:  # noqa: ANN001 - argparse's private subparsers type
    p = bench_sub.add_parser(
        "trainer", help="DeepSpeed trainer group: step, GPS write, offload and reload times"
    )
    p.add_argument("--checkpoint", required=True, help="a Hugging Face Qwen2 checkpoint folder")
    p.add_argument(
        "--world-sizes", type=positive, nargs="+", default=[1, 2], help="ranks (default 1 2)"
    )
    p.add_argument("--steps", type=positive, default=10, help="timed steps (default 10)")
    p.add_argument("--zero-stage", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--json", action="store_true", help="one JSON object per world size")
    p.set_defaults(func=main)
