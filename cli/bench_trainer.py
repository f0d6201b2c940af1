"""`pivot bench trainer`: the DeepSpeed trainer group on its own, once per world size and
number of gradient helpers: startup, training step (the step itself and the whole request),
GPS write, offload and reload; medians in milliseconds, on a batch shaped like the tiny job's.

A gradient helper is an agent process of its own, free of any role (as an inference replica
with nothing to run is), offered to every step as it starts (``pivot.actors.gradient_help``);
``helped_share`` is the median share of a step's tokens whose gradient helpers computed. Each
helper and each rank run one torch thread, so on a host with a core for each, a helper adds a
core's compute to the step.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from pivot.cli.flags import non_negative, positive

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
    helpers: int = 0,
) -> dict[str, Any]:
    """Start a trainer group of ``world_size`` ranks (and ``helpers`` gradient helpers'
    agents), time ``steps`` training steps, GPS writes, offload and reload; medians in
    milliseconds."""
    from pivot.actors.assembly import agent_name, trainer_names
    from pivot.actors.param_store import remove_store
    from pivot.actors.trainer_deepspeed import add_trainer_group
    from pivot.actors.trainer_messages import (
        ComputeGradients,
        GradientHelper,
        HelperGradients,
        OffloadTrainer,
        ReloadTrainer,
        TrainBatch,
        Trained,
    )
    from pivot.actors.vocabulary import rl_messages
    from pivot.bus import Actor, Bus, Directory, Supervisor, job_secret
    from pivot.grpo import TrainingSettings

    run = Path(run_dir)
    names = trainer_names("trainer", world_size)
    # a helper's device numbers follow the ranks'
    offered = [
        GradientHelper(f"helper-{d}", "rollout", [d])
        for d in range(world_size, world_size + helpers)
    ]
    agents = [agent_name(h.devices[0]) for h in offered]
    directory = Directory.ipc(run, [*names, *agents, "bench"])
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
    for agent in agents:
        supervisor.add_process(
            agent, "pivot.cli.bench_trainer:helper_agent", kwargs={"directory": directory.to_dict()}
        )
    await supervisor.start()
    startup = time.perf_counter() - started
    # the ranks sign with the job's secret when one is set: the probe must too
    bus = Bus.nng(directory, rl_messages(), secret=job_secret())
    probe = Actor("bench", bus)
    await probe.start()
    samples = bench_samples()
    step_s, request_s, write_s, offload_s, reload_s, helped = [], [], [], [], [], []
    try:
        # a helper builds the policy's model on its first request: before the steps, not in
        # one (the step would give up waiting for it), with nothing to compute
        warm = ComputeGradients(
            version=0,
            store=store,
            policy=str(checkpoint),
            batches=[],
            denominator=1.0,
            settings=settings or TrainingSettings(),
        )
        for agent in agents:
            await probe.request(agent, warm, timeout=300, expect=HelperGradients)
        # the first step is left out (the group's first step is slower)
        for i in range(steps + 1):
            t = time.perf_counter()
            train = asyncio.create_task(
                probe.request("trainer", TrainBatch(samples=samples, step=i), timeout=300)
            )
            await _offer(probe, offered, train)
            reply: Trained = await train
            if i:
                request_s.append(time.perf_counter() - t)
                step_s.append(reply.stats.seconds)
                write_s.append(reply.gps_write_s)
                helped.append(reply.stats.helped_tokens / max(reply.stats.tokens, 1))
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
        "helpers": helpers,
        "helped_share": round(statistics.median(helped), 3),
        "sequences": len(samples),
        "tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in samples),
        "startup_s": round(startup, 2),
        "train_step_ms": ms(step_s),
        "train_request_ms": ms(request_s),
        "gps_write_ms": ms(write_s),
        "offload_ms": ms(offload_s),
        "reload_ms": ms(reload_s),
    }


async def _offer(probe: Any, offered: list[Any], train: asyncio.Task[Any]) -> None:
    """Offer the helpers to the step until it took them all or it ended (it takes none
    before it starts)."""
    from pivot.actors.trainer_messages import Helping, HelpTrainer

    taken: set[str] = set()
    while offered and not train.done() and len(taken) < len(offered):
        left = [h for h in offered if h.replica not in taken]
        reply = await probe.request("trainer", HelpTrainer(helpers=left), expect=Helping)
        taken.update(reply.replicas)
        await asyncio.sleep(0.001)


def helper_agent(name: str, *, directory: dict[str, Any]) -> Any:
    """Factory for ``Supervisor.add_process``: a gradient helper's agent, free of any role,
    on one torch thread."""
    import torch

    from pivot.actors.agent import RoleAgent
    from pivot.actors.vocabulary import rl_messages
    from pivot.bus import Bus, Directory, job_secret

    torch.set_num_threads(1)
    bus = Bus.nng(Directory.from_dict(directory), rl_messages(), secret=job_secret())
    return RoleAgent(name, bus)


COLUMNS = (
    "world_size",
    "helpers",
    "helped_share",
    "startup_s",
    "train_step_ms",
    "train_request_ms",
    "gps_write_ms",
    "offload_ms",
    "reload_ms",
)


def main(args: argparse.Namespace) -> int:
    from pivot.bus import configure_logging, run_real
    from pivot.cli.run import check_model, logs_to
    from pivot.grpo import TrainingSettings

    configure_logging("warning")  # stdout is the table (or the JSON lines)
    # a folder the ranks cannot load is one line (exit 2) before any rank starts
    check_model(Path(args.checkpoint))
    settings = TrainingSettings(zero_stage=args.zero_stage)
    if args.micro_batch_size is not None:
        settings = msgspec.structs.replace(settings, micro_batch_size=args.micro_batch_size)
    if not args.json:
        print("  ".join(f"{c:>16s}" for c in COLUMNS), flush=True)
    for world_size, helpers in itertools.product(args.world_sizes, args.helpers):
        # the ranks' logs (and DeepSpeed's and transformers' chatter) go to the run's log:
        # stdout is the table, stderr the one line of a failure
        with (
            tempfile.TemporaryDirectory(prefix="pivot-bench-") as run,
            logs_to(Path(run) / "actors.log"),
        ):
            result = run_real(
                bench(
                    args.checkpoint,
                    run,
                    world_size=world_size,
                    steps=args.steps,
                    settings=settings,
                    helpers=helpers,
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
    p.add_argument(
        "--helpers",
        type=non_negative,
        nargs="+",
        default=[0],
        help="gradient helpers offered to every step, one run per number (default 0)",
    )
    p.add_argument(
        "--micro-batch-size",
        type=positive,
        help="sequences per micro-batch (default the trainer's, 32: the 64-sequence batch is "
        "then one or two rounds, too few to share with a helper)",
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON object per world size and helper count"
    )
    p.set_defaults(func=main)
