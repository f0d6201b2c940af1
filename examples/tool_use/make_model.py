"""Make the tool_use example's policy, in well under a minute and without downloading anything:
a Qwen2 model like pivot's tiny policy, with pivot's character tokenizer plus the calculator's
characters ``[]*``, SFT'd on transcripts of the example's task (rollout.py): half call the
calculator and copy its result, half answer at once (a guess: it cannot multiply). SFT stops
at the first check where the example's own rollout function, run over an in-process engine
at the example's temperature, earns a mean reward of ``--target``: the policy starts weak (it
calls the tool only some of the time, and miscopies) and RL has the rest to learn.

    python examples/tool_use/make_model.py [--out examples/models/tool-policy] [--seed 0]
    python examples/tool_use/make_model.py --data examples/tool_use/data/train.jsonl

The second writes the example's prompts (seeded) instead of a model. ``import rollout`` and
``import reward`` are the example's files beside this script.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from pathlib import Path

import reward
import rollout
import torch

from pivot import Chunk, Generation, RewardInput, Task
from pivot.cli.tinymodels import MAX_POSITIONS, model_config, sft
from pivot.engines.protocol import SamplingParams
from pivot.engines.tokenizer import ALPHABET, TextCodec, build_tokenizer, save_pretrained
from pivot.engines.torch_engine import DecoderSpec, TorchEngine

HERE = Path(__file__).resolve().parent
ALPHABET_WITH_TOOL = ALPHABET + rollout.TOOL_CHARACTERS
TEMPERATURE = 1.0  # the example's rollout.temperature
MAX_NEW_TOKENS = 12  # the example's rollout.max_new_tokens
EVAL_SEED = 777
DATA_SEED = 2026


def problems(seed: int, count: int) -> list[tuple[str, str]]:
    """(prompt, product) pairs of two-digit numbers, the same for the same seed."""
    rng = random.Random(seed)
    pairs = ((rng.randint(10, 99), rng.randint(10, 99)) for _ in range(count))
    return [(f"{a}{rollout.OPERATOR}{b}=", str(a * b)) for a, b in pairs]


def transcript(codec: TextCodec, prompt: str, answer: str, use_tool: bool):
    """An SFT example (prompt ids, target ids, weights): the tool's text weighs 0, as the
    rollout masks it."""
    parts = []
    if use_tool:
        call = rollout.OPEN + prompt[:-1] + rollout.CLOSE
        parts += [(call, 1.0), (rollout.calculator(call[: -len(rollout.CLOSE)]), 0.0)]
    parts.append((">" + answer, 1.0))
    target, weights = [], []
    for text, weight in parts:
        ids = codec.encode(text, bos=False)
        target += ids
        weights += [weight] * len(ids)
    return codec.encode(prompt), [*target, codec.eos_id], [*weights, 1.0]


class EngineContext:
    """A rollout's context over an in-process engine (what ``pivot run`` gives it, less the
    schedulers): every rollout's calls are added to one engine, which ``run`` steps."""

    def __init__(self, engine: TorchEngine, codec: TextCodec, task: Task, waiting: dict, ids):
        self.engine, self.tokenizer, self.task = engine, codec, task
        self._waiting, self._ids, self._calls = waiting, ids, 0

    async def generate(self, prompt, *, stop_token_ids=(), max_new_tokens=None, **_):
        seq_id = next(self._ids)
        seed = self.task.sampling.seed * 1_000_003 + self._calls
        self._calls += 1
        sampling = SamplingParams(
            max_new_tokens=max_new_tokens or self.task.sampling.max_new_tokens,
            temperature=self.task.sampling.temperature,
            seed=seed,
            stop_token_ids=tuple(stop_token_ids),
        )
        self.engine.add(seq_id, list(prompt), sampling=sampling)
        future = self._waiting[seq_id] = asyncio.get_running_loop().create_future()
        done = await future
        ids = list(done.token_ids)
        return Generation(
            prompt_ids=list(prompt),
            token_ids=ids,
            logprobs=list(done.logprobs),
            chunks=[Chunk(len(ids), 0)],
            finish_reason=done.finish_reason,
            text=self.tokenizer.decode(ids),
        )


async def _rollouts(engine: TorchEngine, codec: TextCodec, tasks: list[Task]):
    waiting: dict = {}
    ids = itertools.count()
    runs = [
        asyncio.ensure_future(rollout.rollout(EngineContext(engine, codec, t, waiting, ids), t))
        for t in tasks
    ]
    while not all(r.done() for r in runs):
        await asyncio.sleep(0)  # the rollouts whose turn finished add their next turn
        if engine.has_unfinished():
            for f in engine.step().finished:
                waiting.pop(f.seq_id).set_result(f)
    return [r.result() for r in runs]


def evaluate(engine: TorchEngine, codec: TextCodec, pairs, seed: int) -> dict[str, float]:
    """The example's rollout and reward over ``pairs``: mean score and tool calls."""
    tasks = [
        Task(
            seq_id=i,
            step=0,
            group=i,
            sample=0,
            prompt_ids=codec.encode(prompt),
            sampling=SamplingParams(
                max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE, seed=seed * 100_003 + i
            ),
            prompt=prompt,
            reference=answer,
        )
        for i, (prompt, answer) in enumerate(pairs)
    ]
    trajectories = asyncio.run(_rollouts(engine, codec, tasks))
    results = [
        reward.score(
            RewardInput(
                prompt=t.prompt,
                response=codec.decode(traj.response_ids),
                response_ids=traj.response_ids,
                reference=t.reference,
            )
        )
        for t, traj in zip(tasks, trajectories, strict=True)
    ]
    return {k: sum(r[k] for r in results) / len(results) for k in ("score", "tool_calls")}


def make_model(
    out: Path,
    *,
    seed: int = 0,
    target: float = 0.3,
    tool_share: float = 0.5,
    max_steps: int = 400,
    first_check: int = 40,
    batch: int = 64,
    eval_size: int = 128,
    threads: int = 1,
    log=print,
) -> dict:
    """SFT until the rollout's reward reaches ``target`` (or ``max_steps``); save to ``out``."""
    from transformers import Qwen2ForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    started = time.perf_counter()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tok = build_tokenizer(ALPHABET_WITH_TOOL)
    codec = TextCodec.char(ALPHABET_WITH_TOOL)
    model = Qwen2ForCausalLM(model_config(codec, hidden=128, layers=4, intermediate=384))
    engine = TorchEngine(DecoderSpec.from_config(model.config.to_dict()), max_running=eval_size)
    eval_pairs = problems(EVAL_SEED, eval_size)
    rng = random.Random(seed)
    history: list[dict] = []

    def draw(step: int):
        pairs = problems(rng.randrange(2**62), batch)
        return [transcript(codec, p, a, rng.random() < tool_share) for p, a in pairs]

    def check(step: int) -> bool:
        engine.load_weights(model.state_dict(), version=step)
        numbers = evaluate(engine, codec, eval_pairs, seed=step)
        history.append({"step": step, **numbers})
        log(
            f"step {step}: reward {numbers['score']:.3f}, tool calls "
            f"{numbers['tool_calls']:.2f} ({time.perf_counter() - started:.0f} s)"
        )
        return numbers["score"] >= target

    steps = sft(
        model,
        draw,
        pad_id=codec.padding_id,
        max_steps=max_steps,
        lr=3e-3,
        check_every=10,
        check=lambda step: step >= first_check and check(step),
    )
    model.save_pretrained(out)
    save_pretrained(tok, out, model_max_length=MAX_POSITIONS)
    report = {
        "maker": "examples/tool_use/make_model.py",
        "seed": seed,
        "sft_steps": steps,
        "target": target,
        "history": history,
        "seconds": round(time.perf_counter() - started, 1),
    }
    (out / "maker.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"{out}: {steps} SFT steps, {report['seconds']} s")
    return report


def write_data(path: Path, count: int = 1024) -> None:
    rows = [{"prompt": p, "answer": a} for p, a in problems(DATA_SEED, count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE.parent / "models" / "tool-policy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.3, help="the reward SFT stops at")
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--first-check", type=int, default=40, help="the first step checked")
    parser.add_argument("--data", type=Path, help="write the example's prompts here instead")
    args = parser.parse_args()
    if args.data is not None:
        write_data(args.data)
        return 0
    make_model(
        args.out,
        seed=args.seed,
        target=args.target,
        max_steps=args.max_steps,
        first_check=args.first_check,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
