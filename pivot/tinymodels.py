"""The seeded maker of the project's two tiny models: the policy and the GenRM of the task in
``pivot.task``. Run ``python -m pivot.tinymodels --out DIR [--seed S]``.

Both are Qwen2 models (``Qwen2ForCausalLM``) with the project's character tokenizer, saved
with ``save_pretrained`` (config.json, safetensors, tokenizer files), so they load with
``AutoModelForCausalLM.from_pretrained`` like any local checkpoint. Nothing is downloaded.

* policy: a short SFT on worked responses, stopped at the first evaluation where its sampled
  (temperature 1) accuracy reaches a target, so RL starts weak but not at zero.
* GenRM: SFT on (prompt, response, reference) -> judgment ending in a verdict, over a mix of
  right responses, wrong answers (scrambled digits, near misses), malformed responses and
  samples of the weak policy itself (labelled by the exact checker), on a decaying learning
  rate, stopping early once it agrees with the checker on the evaluation set. The column
  marks of the judgment weigh more in the loss: they decide the verdict.

Both are seeded: the same seed and thread count give the same models. One thread is the
default: for models this small it is about as fast as two on an idle machine and far faster
on a busy one. The maker writes DIR/tiny-policy, DIR/tiny-genrm, DIR/models.json (seed,
accuracies, sizes, times) and DIR/README.md. The evaluation helpers here are also what the
tests use.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from pivot import task
from pivot.engine import SamplingParams
from pivot.tokenizer import ALPHABET, TextCodec, build_tokenizer, save_pretrained
from pivot.torch_engine import Qwen2Spec, TorchEngine, generate

POLICY_DIR = "tiny-policy"
GENRM_DIR = "tiny-genrm"
REPORT = "models.json"
ASSETS = Path(__file__).parent / "assets"

# fixed evaluation sets: the maker records its numbers on these, the tests recompute them
EVAL_SEED = 424242
EVAL_SIZE = 128
POLICY_MAX_NEW_TOKENS = 32
GENRM_MAX_NEW_TOKENS = 32
MAX_POSITIONS = 128


def model_config(codec: TextCodec, hidden: int, layers: int, intermediate: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=codec.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=codec.bos_id,
        eos_token_id=codec.eos_id,
        pad_token_id=codec.pad_id,
        dtype="float32",
    )


# ---- data -------------------------------------------------------------------------------------


def policy_example(codec: TextCodec, problem: task.Problem) -> tuple[list[int], list[int]]:
    """(prompt ids, target ids): the worked response and eos."""
    target = codec.encode(task.worked_response(problem.prompt), bos=False) + [codec.eos_id]
    return codec.encode(problem.prompt), target


def genrm_example(
    codec: TextCodec, problem: task.Problem, response: str
) -> tuple[list[int], list[int]]:
    prompt = task.genrm_prompt(problem.prompt, response, problem.reference)
    target = codec.encode(task.ideal_judgment(response, problem.reference), bos=False)
    return codec.encode(prompt), target + [codec.eos_id]


def near_miss(rng: random.Random, answer: str) -> str:
    """A wrong answer close to the right one: off by a little, a digit changed, moved,
    dropped or added."""
    value = int(answer)
    while True:
        kind = rng.randrange(6)
        if kind == 0:
            out = str(max(0, value + rng.choice([-2, -1, 1, 2])))
        elif kind == 1:
            out = str(max(0, value + rng.choice([-100, -10, 10, 100])))
        elif kind == 2 and len(answer) > 1:
            i = rng.randrange(len(answer) - 1)
            out = answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
        elif kind == 3 and len(answer) > 1:
            i = rng.randrange(len(answer))
            out = answer[:i] + answer[i + 1 :]
        elif kind == 4:
            i = rng.randrange(len(answer) + 1)
            out = answer[:i] + str(rng.randrange(10)) + answer[i:]
        else:
            i = rng.randrange(len(answer))
            out = answer[:i] + str(rng.randrange(10)) + answer[i + 1 :]
        if out != answer:
            return out


def scrambled(rng: random.Random, answer: str) -> str:
    """A wrong answer whose digits each stay w.p. 1/2, sometimes a digit longer or shorter:
    many columns to compare per example, so the GenRM's column check learns fast."""
    while True:
        out = "".join(c if rng.random() < 0.5 else str(rng.randrange(10)) for c in answer)
        if rng.random() < 0.2:
            out = out[:-1] if rng.random() < 0.5 else out + str(rng.randrange(10))
        if out and out != answer:
            return out


def corrupted_response(rng: random.Random, problem: task.Problem) -> str:
    """A wrong or malformed response to a problem."""
    good = task.worked_response(problem.prompt)
    head = good.rpartition(task.ANSWER_MARK)[0]
    kind = rng.random()
    if kind < 0.35:  # a clean scratchpad with a wrong answer: the judge must read the answer
        return head + task.ANSWER_MARK + scrambled(rng, problem.reference)
    if kind < 0.6:
        return head + task.ANSWER_MARK + near_miss(rng, problem.reference)
    if kind < 0.75:  # cut off before the answer
        return good[: rng.randrange(len(head) + 1)]
    if kind < 0.85:  # a mark without digits, or digits with junk
        return head + task.ANSWER_MARK + rng.choice(["", " ", "x", problem.reference + "a"])
    if kind < 0.95:  # random characters
        chars = ALPHABET.replace("\n", "")
        return "".join(rng.choice(chars) for _ in range(rng.randrange(1, 30)))
    # the right answer before a second mark: only the last one counts
    wrong = near_miss(rng, problem.reference)
    return f"{head}{task.ANSWER_MARK}{problem.reference} {task.ANSWER_MARK}{wrong}"


def sample_responses(
    engine: TorchEngine,
    codec: TextCodec,
    problems: Sequence[task.Problem],
    temperature: float,
    seed: int,
) -> list[str]:
    """One response per problem from the engine (seeded per problem)."""
    params = [
        SamplingParams(
            max_new_tokens=POLICY_MAX_NEW_TOKENS, temperature=temperature, seed=seed * 100003 + i
        )
        for i in range(len(problems))
    ]
    outs = generate(engine, [codec.encode(p.prompt) for p in problems], params)
    return [codec.decode(o.token_ids) for o in outs]


def policy_accuracy(
    engine: TorchEngine,
    codec: TextCodec,
    problems: Sequence[task.Problem],
    temperature: float = 0.0,
    seed: int = 0,
) -> float:
    responses = sample_responses(engine, codec, problems, temperature, seed)
    hits = sum(task.is_correct(r, p.reference) for r, p in zip(responses, problems, strict=True))
    return hits / len(problems)


def genrm_eval_items(
    policy: TorchEngine, codec: TextCodec, problems: Sequence[task.Problem], seed: int
) -> list[tuple[task.Problem, str]]:
    """(problem, response) pairs to judge: per problem one policy sample at temperature 1,
    one right response and one corrupted response."""
    rng = random.Random(seed)
    samples = sample_responses(policy, codec, problems, temperature=1.0, seed=seed)
    items = []
    for p, sample in zip(problems, samples, strict=True):
        items.append((p, sample))
        items.append((p, task.worked_response(p.prompt)))
        items.append((p, corrupted_response(rng, p)))
    return items


def genrm_agreement(
    genrm: TorchEngine, codec: TextCodec, items: Sequence[tuple[task.Problem, str]]
) -> tuple[float, int]:
    """(fraction of items where the GenRM's verdict equals the exact checker's, malformed
    judgments). Greedy judgments."""
    prompts = [codec.encode(task.genrm_prompt(p.prompt, r, p.reference)) for p, r in items]
    outs = generate(
        genrm, prompts, SamplingParams(max_new_tokens=GENRM_MAX_NEW_TOKENS, temperature=0.0)
    )
    agree = malformed = 0
    for (p, r), out in zip(items, outs, strict=True):
        judgment = task.parse_judgment(codec.decode(out.token_ids))
        malformed += judgment.malformed
        agree += (judgment.score == 1.0) == task.is_correct(r, p.reference)
    return agree / len(items), malformed


# ---- training ---------------------------------------------------------------------------------


def _batch(
    examples: Sequence[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) + len(t) for p, t in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (p, t) in enumerate(examples):
        ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
    return ids, labels


def sft(
    model,
    draw: Callable[[int], Sequence[tuple[list[int], list[int]]]],
    *,
    pad_id: int,
    max_steps: int,
    lr: float,
    check_every: int,
    check: Callable[[int], bool],
    warmup: int = 20,
    decay: bool = False,
    upweight: Sequence[int] = (),
    upweight_factor: float = 1.0,
) -> int:
    """Train on draw(step) batches (loss on targets only; target tokens in ``upweight``
    count ``upweight_factor`` times) until check(step) says stop or max_steps; returns the
    steps taken. The learning rate warms up linearly, then stays (or, with ``decay``, falls
    linearly to a tenth at max_steps)."""
    boosted = torch.tensor(sorted(upweight), dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    step = 0
    for step in range(1, max_steps + 1):
        scale = min(1.0, step / warmup)
        if decay and step > warmup:
            scale = 1.0 - 0.9 * (step - warmup) / max(1, max_steps - warmup)
        for group in opt.param_groups:
            group["lr"] = lr * scale
        ids, labels = _batch(draw(step), pad_id)
        logits = model(input_ids=ids).logits
        targets = labels[:, 1:].reshape(-1)
        per_token = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), targets, reduction="none"
        )
        weight = (targets != -100).float()
        if len(boosted):
            weight = torch.where(torch.isin(targets, boosted), weight * upweight_factor, weight)
        loss = (per_token * weight).sum() / weight.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % check_every == 0 or step == max_steps:
            model.eval()
            stop = check(step)
            model.train()
            if stop:
                break
    model.eval()
    return step


def _engine_for(model, max_running: int) -> TorchEngine:
    spec = Qwen2Spec.from_config(model.config.to_dict(), source="in-memory config")
    engine = TorchEngine(spec, max_running=max_running)
    engine.load_weights(model.state_dict(), version=0)
    return engine


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def make_models(
    out: str | Path,
    seed: int = 0,
    *,
    threads: int = 1,
    policy_target: float = 0.15,
    policy_max_steps: int = 400,
    genrm_target: float = 0.985,
    genrm_max_steps: int = 400,
    policy_batch: int = 64,
    genrm_batch: int = 32,
    eval_size: int = EVAL_SIZE,
    log: Callable[[str], None] = print,
) -> dict:
    """Make, evaluate and save both models under ``out``; returns (and writes) the report."""
    from transformers import Qwen2ForCausalLM

    started = time.perf_counter()
    cpu_started = time.process_time()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out = Path(out)
    tok = build_tokenizer()
    codec = TextCodec(tok)
    eval_problems = task.make_problems(EVAL_SEED, eval_size)
    data_rng = random.Random(seed)

    # policy: SFT until the sampled accuracy first reaches the target
    policy = Qwen2ForCausalLM(model_config(codec, hidden=128, layers=4, intermediate=384))
    policy_engine = TorchEngine(
        Qwen2Spec.from_config(policy.config.to_dict()), max_running=eval_size
    )
    history: list[dict] = []

    def policy_check(step: int) -> bool:
        policy_engine.load_weights(policy.state_dict(), version=step)
        greedy = policy_accuracy(policy_engine, codec, eval_problems, 0.0)
        sampled = policy_accuracy(policy_engine, codec, eval_problems, 1.0, seed=step)
        history.append({"step": step, "greedy": greedy, "sampled": sampled})
        log(
            f"policy step {step}: greedy {greedy:.3f} sampled {sampled:.3f} "
            f"({time.perf_counter() - started:.0f} s)"
        )
        return sampled >= policy_target

    def policy_draw(step: int):
        problems = task.make_problems(data_rng.randrange(2**62), policy_batch)
        return [policy_example(codec, p) for p in problems]

    t0 = time.perf_counter()
    policy_steps = sft(
        policy,
        policy_draw,
        pad_id=codec.pad_id,
        max_steps=policy_max_steps,
        lr=3e-3,
        check_every=10,
        check=lambda step: step >= 80 and policy_check(step),
    )
    policy_s = time.perf_counter() - t0
    policy_engine.load_weights(policy.state_dict(), version=policy_steps)

    # GenRM: judgments of right, near-miss, malformed and weak-policy responses
    genrm = Qwen2ForCausalLM(model_config(codec, hidden=128, layers=4, intermediate=384))
    genrm_engine = TorchEngine(
        Qwen2Spec.from_config(genrm.config.to_dict()), max_running=3 * eval_size
    )
    genrm_items = genrm_eval_items(policy_engine, codec, eval_problems, seed=EVAL_SEED)
    pool: list[tuple[task.Problem, str]] = []

    def genrm_draw(step: int):
        problems = task.make_problems(data_rng.randrange(2**62), genrm_batch)
        if len(pool) < genrm_batch:  # weak-policy samples, refilled from fresh prompts
            fresh = task.make_problems(data_rng.randrange(2**62), 8 * genrm_batch)
            samples = sample_responses(policy_engine, codec, fresh, 1.0, data_rng.randrange(2**30))
            pool.extend(zip(fresh, samples, strict=True))
        batch = []
        for p in problems:
            kind = data_rng.random()
            if kind < 0.25:
                batch.append(genrm_example(codec, p, task.worked_response(p.prompt)))
            elif kind < 0.7:
                batch.append(genrm_example(codec, p, corrupted_response(data_rng, p)))
            else:
                q, response = pool.pop()
                batch.append(genrm_example(codec, q, response))
        return batch

    genrm_history: list[dict] = []

    def genrm_check(step: int) -> bool:
        genrm_engine.load_weights(genrm.state_dict(), version=step)
        agreement, malformed = genrm_agreement(genrm_engine, codec, genrm_items)
        genrm_history.append({"step": step, "agreement": agreement, "malformed": malformed})
        log(
            f"genrm step {step}: agreement {agreement:.4f} malformed {malformed} "
            f"({time.perf_counter() - started:.0f} s)"
        )
        return agreement >= genrm_target

    t0 = time.perf_counter()
    genrm_steps = sft(
        genrm,
        genrm_draw,
        pad_id=codec.pad_id,
        max_steps=genrm_max_steps,
        lr=2e-3,
        decay=True,
        check_every=50,
        check=lambda step: step >= 250 and genrm_check(step),
        # the column marks decide the verdict but are few among the judgment's tokens
        upweight=codec.encode("=x", bos=False),
        upweight_factor=5.0,
    )
    genrm_s = time.perf_counter() - t0
    genrm_engine.load_weights(genrm.state_dict(), version=genrm_steps)

    # final numbers on the fixed evaluation sets, from the saved weights' engines
    greedy = policy_accuracy(policy_engine, codec, eval_problems, 0.0)
    sampled = policy_accuracy(policy_engine, codec, eval_problems, 1.0, seed=EVAL_SEED)
    agreement, malformed = genrm_agreement(genrm_engine, codec, genrm_items)
    # decode work per sequence (one token per character, plus bos or eos)
    samples = [r for p, r in genrm_items[::3]]
    response_tokens = sum(len(r) + 1 for r in samples) / len(samples)
    judgment_tokens = sum(
        len(task.ideal_judgment(r, p.reference)) + 1 for p, r in genrm_items
    ) / len(genrm_items)
    genrm_prompt_tokens = sum(
        len(task.genrm_prompt(p.prompt, r, p.reference)) + 1 for p, r in genrm_items
    ) / len(genrm_items)

    sizes = {}
    for name, model in ((POLICY_DIR, policy), (GENRM_DIR, genrm)):
        folder = out / name
        model.save_pretrained(folder)
        save_pretrained(tok, folder, model_max_length=MAX_POSITIONS)
        sizes[name] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "bytes": _folder_bytes(folder),
        }
    report = {
        "maker": "python -m pivot.tinymodels",
        "seed": seed,
        "threads": threads,
        "task": {"digits": task.DIGITS, "eval_seed": EVAL_SEED, "eval_size": eval_size},
        "policy": {
            "dir": POLICY_DIR,
            "sft_steps": policy_steps,
            "sft_seconds": round(policy_s, 1),
            "stop_rule": f"first check (every 10 steps from 80) with sampled accuracy >= "
            f"{policy_target}",
            "eval_greedy_accuracy": greedy,
            "eval_sampled_accuracy_t1": sampled,
            "mean_response_tokens_t1": round(response_tokens, 1),
            "history": history,
            **sizes[POLICY_DIR],
        },
        "genrm": {
            "dir": GENRM_DIR,
            "sft_steps": genrm_steps,
            "sft_seconds": round(genrm_s, 1),
            "eval_items": len(genrm_items),
            "eval_agreement": agreement,
            "eval_malformed": malformed,
            "mean_prompt_tokens": round(genrm_prompt_tokens, 1),
            "mean_judgment_tokens": round(judgment_tokens, 1),
            "history": genrm_history,
            **sizes[GENRM_DIR],
        },
        "total_bytes": sizes[POLICY_DIR]["bytes"] + sizes[GENRM_DIR]["bytes"],
        "wall_seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds": round(time.process_time() - cpu_started, 1),
        "versions": {"torch": torch.__version__, "transformers": _transformers_version()},
    }
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    (out / "README.md").write_text(_readme(report))
    log(
        f"policy: {policy_steps} steps, greedy {greedy:.3f}, sampled {sampled:.3f}; "
        f"genrm: {genrm_steps} steps, agreement {agreement:.4f}, malformed {malformed}; "
        f"{report['total_bytes'] / 1e6:.1f} MB, {report['wall_seconds']} s"
    )
    return report


def _readme(report: dict) -> str:
    policy, genrm = report["policy"], report["genrm"]
    return f"""# pivot's tiny models

Made by `python -m pivot.tinymodels --out DIR --seed {report["seed"]} --threads \
{report["threads"]}` in {report["wall_seconds"]} s ({report["cpu_seconds"]} s of CPU);
nothing downloaded. Qwen2 (`Qwen2ForCausalLM`), fp32 safetensors, the project's character
tokenizer (`pivot.tokenizer`). Task: `pivot.task` (two-digit addition with a scratchpad).
Full numbers: `{REPORT}`.

| model | parameters | bytes | SFT steps | evaluation (fixed set, seed {EVAL_SEED}) |
|---|---|---|---|---|
| `{POLICY_DIR}` | {policy["parameters"]:,} | {policy["bytes"]:,} | {policy["sft_steps"]} | \
greedy accuracy {policy["eval_greedy_accuracy"]:.3f}, sampled (T=1) \
{policy["eval_sampled_accuracy_t1"]:.3f} on {report["task"]["eval_size"]} problems |
| `{GENRM_DIR}` | {genrm["parameters"]:,} | {genrm["bytes"]:,} | {genrm["sft_steps"]} | \
agreement with the exact checker {genrm["eval_agreement"]:.4f} on {genrm["eval_items"]} \
judgments ({genrm["eval_malformed"]} malformed) |

The policy is stopped early on purpose (first check with sampled accuracy >= its target),
so RL starts weak but not at zero. A response is about {policy["mean_response_tokens_t1"]}
tokens; a GenRM prompt about {genrm["mean_prompt_tokens"]} and its judgment about
{genrm["mean_judgment_tokens"]}.
"""


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pivot.tinymodels", description="Make pivot's tiny policy and GenRM."
    )
    parser.add_argument("--out", required=True, help="folder to write the models into")
    parser.add_argument("--seed", type=int, default=0)
    # one thread is about as fast for models this small and far faster on a busy machine
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    make_models(args.out, args.seed, threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
