"""Write two user-style models for the examples, in seconds and without downloading anything:
examples/models/policy, Llama-shaped with a Llama-3-style tokenizer, and examples/models/genrm,
Qwen3-shaped with its own ChatML-style tokenizer (another vocabulary, so the two models' ids
for the same text differ). Both are random-weight checkpoints (pivot.cli.newmodel).

    python examples/make_models.py [--out examples/models] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pivot import task
from pivot.cli import newmodel


def judge_corpus() -> list[str]:
    """The GenRM's reading: task prompts, responses and judgments, besides the default text."""
    texts = newmodel.default_corpus()
    for p in task.make_problems(1, 200):
        response = task.worked_response(p.prompt)
        texts.append(task.genrm_prompt(p.prompt, response, p.reference))
        texts.append(task.ideal_judgment(response, p.reference))
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "models")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from transformers.utils import logging

    logging.disable_progress_bar()  # a bar per one-shard save is all noise here
    policy_tok = newmodel.byte_level_bpe(newmodel.default_corpus(), 512, style="llama3")
    genrm_tok = newmodel.byte_level_bpe(judge_corpus(), 384, style="chatml")
    for name, family, tok, seed in (
        ("policy", "llama", policy_tok, args.seed),
        ("genrm", "qwen3", genrm_tok, args.seed + 1),
    ):
        folder = newmodel.random_checkpoint(args.out / name, family, tok, seed=seed)
        print(f"{folder}: {family}, {len(tok)} tokens, eos {tok.eos_token!r}")


if __name__ == "__main__":
    main()
