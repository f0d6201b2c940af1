"""The seeded maker of the project's two tiny models: the policy and the GenRM of the task in
``pivot.task``. Run ``python -m pivot.cli.tinymodels --out DIR [--seed S]``.

Both are Qwen2 models (``Qwen2ForCausalLM``) with the project's character tokenizer, saved
with ``save_pretrained`` (config.json, safetensors, tokenizer files), so they load with
``AutoModelForCausalLM.from_pretrained`` like any local checkpoint. Nothing is downloaded.

* policy: a short SFT on worked responses, stopped at the first evaluation where its sampled
  (temperature 1) accuracy reaches a target, so RL starts weak but not at zero.
* GenRM: SFT on (prompt, response, reference) -> judgment ending in a verdict, over a mix of
  right responses, wrong answers (scrambled digits, near misses), malformed responses and
  samples of the weak policy itself (labelled by the exact checker), on a decaying learning
  rate, stopping early once it agrees with the checker on the evaluation set. The tokens of
  the judgment that decide the verdict weigh more in the loss.

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
from pivot.engines.protocol import SamplingParams
from pivot.engines.tokenizer import ALPHABET, TextCodec, build_tokenizer, save_pretrained
from pivot.engines.torch_engine import DecoderSpec, TorchEngine, generate

# (prompt ids, target ids, loss weight per target token)
Example = tuple[list[int], list[int], list[float]]

POLICY_DIR = "tiny-policy"
GENRM_DIR = "tiny-genrm"
REPORT = "models.json"

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


# loss weights of the judgment's column groups ("gr=" : response char, reference char, mark):
# copying the reference's character and the mark decide the verdict, and "copy the response's
# character again" is a shortcut that is right in most columns, so they count more
REFERENCE_WEIGHT = 3.0
MARK_WEIGHT = 5.0


def policy_example(codec: TextCodec, problem: task.Problem) -> Example:
    """The prompt, then the worked response and eos as the target."""
    target = codec.encode(task.worked_response(problem.prompt), bos=False) + [codec.eos_id]
    return codec.encode(problem.prompt), target, [1.0] * len(target)


def genrm_example(codec: TextCodec, problem: task.Problem, response: str) -> Example:
    """The GenRM prompt, then the ideal judgment and eos as the target."""
    prompt = task.genrm_prompt(problem.prompt, response, problem.reference)
    judgment = task.ideal_judgment(response, problem.reference)
    groups = judgment.rpartition(":")[0]
    weights = [
        (REFERENCE_WEIGHT if i % 4 == 1 else MARK_WEIGHT if i % 4 == 2 else 1.0)
        if i < len(groups)
        else 1.0
        for i in range(len(judgment) + 1)
    ]
    return codec.encode(prompt), codec.encode(judgment, bos=False) + [codec.eos_id], weights


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
    examples: Sequence[Example], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, labels (-100 off the targets) and per-position loss weights."""
    width = max(len(p) + len(t) for p, t, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    weights = torch.zeros((len(examples), width))
    for i, (p, t, w) in enumerate(examples):
        if len(w) != len(t):
            raise ValueError(f"example {i}: {len(t)} target tokens but {len(w)} weights")
        ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
        weights[i, len(p) : len(p) + len(t)] = torch.tensor(w)
    return ids, labels, weights


def sft(
    model,
    draw: Callable[[int], Sequence[Example]],
    *,
    pad_id: int,
    max_steps: int,
    lr: float,
    check_every: int,
    check: Callable[[int], bool],
    warmup: int = 20,
    decay: bool = False,
) -> int:
    """Train on draw(step) batches (weighted loss on the targets) until check(step) says
    stop or max_steps; returns the steps taken. The learning rate warms up linearly, then
    stays (or, with ``decay``, falls linearly to a tenth at max_steps)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    step = 0
    for step in range(1, max_steps + 1):
        scale = min(1.0, step / warmup)
        if decay and step > warmup:
            scale = 1.0 - 0.9 * (step - warmup) / max(1, max_steps - warmup)
        for group in opt.param_groups:
            group["lr"] = lr * scale
        ids, labels, weights = _batch(draw(step), pad_id)
        logits = model(input_ids=ids).logits
        per_token = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            reduction="none",
        )
        weight = weights[:, 1:].reshape(-1)
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
    spec = DecoderSpec.from_config(model.config.to_dict(), source="in-memory config")
    engine = TorchEngine(spec, max_running=max_running)
    engine.load_weights(model.state_dict(), version=0)
    return engine


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def make_models(
    out: str | Path,
    seed: int = 0,
    *,
    threads: int = 2,
    policy_target: float = 0.15,
    policy_max_steps: int = 400,
    genrm_target: float = 0.99,
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
    codec = TextCodec.char()
    eval_problems = task.make_problems(EVAL_SEED, eval_size)
    data_rng = random.Random(seed)

    # policy: SFT until the sampled accuracy first reaches the target
    policy = Qwen2ForCausalLM(model_config(codec, hidden=128, layers=4, intermediate=384))
    policy_engine = TorchEngine(
        DecoderSpec.from_config(policy.config.to_dict()),
        max_running=max(eval_size, 8 * genrm_batch),  # one wave per refill of the pool below
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
        pad_id=codec.padding_id,
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
        DecoderSpec.from_config(genrm.config.to_dict()), max_running=3 * eval_size
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
            worked = task.worked_response(p.prompt)
            if kind < 0.2:
                response = worked
            elif kind < 0.7:  # columns differ about half the time: no "copy it again" shortcut
                head = worked.rpartition(task.ANSWER_MARK)[0]
                response = head + task.ANSWER_MARK + scrambled(data_rng, p.reference)
            elif kind < 0.8:
                response = corrupted_response(data_rng, p)
            else:
                p, response = pool.pop()
            batch.append(genrm_example(codec, p, response))
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
        pad_id=codec.padding_id,
        max_steps=genrm_max_steps,
        lr=2e-3,
        decay=True,
        check_every=50,
        check=lambda step: step >= 200 and genrm_check(step),
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
        for f in folder.iterdir():
            f.chmod(0o644)  # safetensors writes 0600; these files are meant to be shared
        sizes[name] = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "bytes": _folder_bytes(folder),
        }
    report = {
        "maker": "python -m pivot.cli.tinymodels",
        "seed": seed,
        "threads": threads,
        "task": {"digits": task.DIGITS, "eval_seed": EVAL_SEED, "eval_size": eval_size},
        "policy": {
            "dir": POLICY_DIR,
            "sft_steps": policy_steps,
            "sft_seconds": round(policy_s, 1),
            "stop_rule": f"the first check, every 10 steps from step 80, with sampled "
            f"accuracy >= {policy_target}",
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

Made by `python -m pivot.cli.tinymodels --out DIR --seed {report["seed"]} --threads \
{report["threads"]}` in {report["wall_seconds"]} s ({report["cpu_seconds"]} s of CPU);
nothing downloaded. Qwen2 (`Qwen2ForCausalLM`), fp32 safetensors, the project's character
tokenizer (`pivot.engines.tokenizer`). Task: `pivot.task` (two-digit addition with a scratchpad).
Full numbers: `{REPORT}`.

| model | parameters | bytes | SFT steps | evaluation (fixed set, seed {EVAL_SEED}) |
|---|---|---|---|---|
| `{POLICY_DIR}` | {policy["parameters"]:,} | {policy["bytes"]:,} | {policy["sft_steps"]} | \
greedy accuracy {policy["eval_greedy_accuracy"]:.3f}, sampled (T=1) \
{policy["eval_sampled_accuracy_t1"]:.3f} on {report["task"]["eval_size"]} problems |
| `{GENRM_DIR}` | {genrm["parameters"]:,} | {genrm["bytes"]:,} | {genrm["sft_steps"]} | \
agreement with the exact checker {genrm["eval_agreement"]:.4f} on {genrm["eval_items"]} \
judgments ({genrm["eval_malformed"]} malformed) |

The policy is stopped early on purpose ({policy["stop_rule"]}), so RL starts weak but not
at zero. Decode work per sequence (mean tokens): response {policy["mean_response_tokens_t1"]},
GenRM prompt {genrm["mean_prompt_tokens"]}, judgment {genrm["mean_judgment_tokens"]}.
"""


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pivot.cli.tinymodels", description="Make pivot's tiny policy and GenRM."
    )
    parser.add_argument("--out", required=True, help="folder to write the models into")
    parser.add_argument("--seed", type=int, default=0)
    # one thread is about as fast for models this small and far faster on a busy machine
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    make_models(args.out, args.seed, threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
