"""User-style models made in seconds, for examples and tests: a standard byte-level BPE
tokenizer trained on a small corpus (special tokens and a chat template in the style of real
models, none of pivot's character-tokenizer names), and a random-weight Hugging Face causal-LM
checkpoint of one of the families pivot's engine serves, saved with ``save_pretrained`` beside
that tokenizer. Nothing is downloaded.

    byte_level_bpe(texts, vocab_size=512, style="chatml") -> PreTrainedTokenizerFast
    random_checkpoint(folder, family, tokenizer, ...)     -> Path
    pivot new-model DIR --family llama|qwen3|qwen2|mistral [--vocab-size N] ...
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pivot.cli.flags import non_negative, positive, unmade_dir
from pivot.config import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

#: family -> the transformers config class that writes its config.json
CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "qwen3": "Qwen3Config",
    "qwen2": "Qwen2Config",
    "mistral": "MistralConfig",
}

# raise_exception is the helper transformers gives chat templates for input they reject
_ROLE_CHECK = (
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('roles are system, user and assistant, not ' + message['role']) -}}"
    "{%- endif -%}"
)

# Qwen2/Qwen3 style: no bos, a turn ends with <|im_end|> (the eos), <|endoftext|> pads
CHATML = {
    "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "bos": None,
    "eos": "<|im_end|>",
    "pad": "<|endoftext|>",
    "template": (
        "{%- for message in messages -%}" + _ROLE_CHECK + "{{- '<|im_start|>' + message['role'] + "
        "'\\n' + message['content'] + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    ),
}

# Llama 3 style: a bos the tokenizer prepends (and the template writes), a turn ends with
# <|eot_id|> (the eos), no pad token
LLAMA3 = {
    "specials": [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ],
    "bos": "<|begin_of_text|>",
    "eos": "<|eot_id|>",
    "pad": None,
    "template": (
        "{{- bos_token -}}"
        "{%- for message in messages -%}" + _ROLE_CHECK + "{{- '<|start_header_id|>' + "
        "message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
        "'<|eot_id|>' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
        "{%- endif -%}"
    ),
}

STYLES = {"chatml": CHATML, "llama3": LLAMA3}
#: the tokenizer style a family's checkpoint gets from ``pivot new-model``
FAMILY_STYLES = {"llama": "llama3", "qwen3": "chatml", "qwen2": "chatml", "mistral": "chatml"}

_ENGLISH = """\
The quick brown fox jumps over the lazy dog.
A model reads a prompt and writes a response, one token at a time.
Add the numbers column by column, starting from the units, and carry the tens.
The answer is correct when it equals the reference; otherwise it is wrong.
You are a helpful assistant. Answer the question briefly and show your work.
What is the sum of these two numbers? Think step by step, then give the answer.
Reinforcement learning rewards the responses that solve the task.
"""


def default_corpus() -> list[str]:
    """A small English and arithmetic corpus: a few sentences, task prompts and worked
    responses (``pivot.task``), the same every time."""
    from pivot import task

    texts = _ENGLISH.splitlines()
    for p in task.make_problems(0, 200):
        response = task.worked_response(p.prompt)
        texts.append(f"{p.prompt}{response}")
        texts.append(f"What is {p.prompt[:-1]}? The answer is {p.reference}.")
    return texts


def byte_level_bpe(
    texts: Iterable[str], vocab_size: int = 512, *, style: str = "chatml"
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 pre-tokenizer and decoder: every byte is encodable)
    trained on texts, with the special tokens and ChatML or Llama-3 chat template of ``style``.
    The special tokens take the last ids, as in real models; ``len(tokenizer) == vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if style not in STYLES:
        raise ValueError(f"style must be one of {', '.join(STYLES)}, not {style!r}")
    kind = STYLES[style]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    base = vocab_size - len(kind["specials"])
    if base < len(alphabet):
        raise ValueError(
            f"vocab_size must be at least {len(alphabet) + len(kind['specials'])} "
            f"(256 bytes and {len(kind['specials'])} special tokens), not {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=base, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens(kind["specials"])
    post = [processors.ByteLevel(trim_offsets=False)]
    if kind["bos"] is not None:
        bos = kind["bos"]
        post.append(
            processors.TemplateProcessing(
                single=f"{bos} $A",
                pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, tok.token_to_id(bos))],
            )
        )
    tok.post_processor = processors.Sequence(post)
    specials = {
        f"{name}_token": kind[name] for name in ("bos", "eos", "pad") if kind[name] is not None
    }
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=kind["template"],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
        **specials,
    )
    if len(out) != vocab_size:  # a corpus too small to learn enough merges
        raise ValueError(
            f"the corpus gave {len(out)} tokens, not vocab_size {vocab_size}: "
            "give more text or a smaller vocab_size"
        )
    return out


def random_checkpoint(
    folder: str | Path,
    family: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int = 128,
    max_positions: int = 512,
    seed: int = 0,
) -> Path:
    """A random-weight causal LM of ``family`` (see ``CONFIG_CLASSES``) sized for the
    tokenizer, saved with ``save_pretrained`` (config.json, model.safetensors,
    generation_config.json) and the tokenizer beside it. The same seed gives the same
    weights; the caller's torch RNG is left as it was."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    if family not in CONFIG_CLASSES:
        raise ValueError(f"family must be one of {', '.join(CONFIG_CLASSES)}, not {family!r}")
    if hidden_size % heads or heads % kv_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must divide by heads ({heads}), "
            f"and heads by kv_heads ({kv_heads})"
        )
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token")
    specials = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    extra: dict[str, Any] = {"sliding_window": None} if family == "mistral" else {}
    config = getattr(transformers, CONFIG_CLASSES[family])(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        max_position_embeddings=max_positions,
        dtype="float32",
        **specials,
        **extra,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(**specials)
    out = Path(folder)
    model.save_pretrained(out)  # transformers 5 always writes safetensors
    tokenizer.save_pretrained(out)
    return out


# ---- pivot new-model -------------------------------------------------------------------------


def read_corpus(path: Path) -> list[str]:
    """Texts of a .txt file (one per non-empty line) or a .jsonl file (one per line: a JSON
    string or an object with a "text" string)."""
    if not path.is_file():
        raise ConfigError(str(path), "", "a corpus file (.jsonl or .txt)", "no such file")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    if path.suffix == ".jsonl":
        texts = list(_jsonl_texts(path, lines))
    elif path.suffix == ".txt":
        texts = [line for line in lines if line.strip()]
    else:
        raise ConfigError(str(path), "", "a .jsonl or .txt file", repr(path.suffix or "no suffix"))
    if not texts:
        raise ConfigError(str(path), "", "some text", "none")
    return texts


def _jsonl_texts(path: Path, lines: list[str]) -> Iterator[str]:
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{path}:{n}", "", "a JSON value", str(exc)) from None
        text = item.get("text") if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise ConfigError(f"{path}:{n}", "", 'a string or an object with a "text" string', line)
        yield text


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``new-model`` (and its flags) on the ``pivot`` command's subparsers."""
    p = subparsers.add_parser(
        "new-model",
        help="a random-weight checkpoint with its own byte-level BPE tokenizer, in seconds",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("dir", help="folder to write the checkpoint into")
    p.add_argument("--family", required=True, choices=tuple(CONFIG_CLASSES))
    p.add_argument("--vocab-size", type=positive, default=512, help="tokens (default 512)")
    p.add_argument("--hidden-size", type=positive, default=64, help="default 64")
    p.add_argument("--layers", type=positive, default=2, help="default 2")
    p.add_argument("--seed", type=non_negative, default=0)
    p.add_argument(
        "--corpus", type=Path, default=None, help="FILE.jsonl or FILE.txt (default: built in)"
    )
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from transformers.utils import logging

    logging.disable_progress_bar()  # the one shard's bar would be the command's only stderr
    texts = read_corpus(args.corpus) if args.corpus is not None else default_corpus()
    style = FAMILY_STYLES[args.family]
    try:
        tokenizer = byte_level_bpe(texts, args.vocab_size, style=style)
        folder = random_checkpoint(
            args.dir,
            args.family,
            tokenizer,
            hidden_size=args.hidden_size,
            intermediate_size=2 * args.hidden_size,
            layers=args.layers,
            seed=args.seed,
        )
    except ValueError as exc:
        raise ConfigError("pivot new-model", "", "flags that make a model", str(exc)) from None
    except OSError as exc:
        raise unmade_dir(args.dir, "dir", exc) from None
    print(
        f"wrote {folder}: {args.family}, vocab {len(tokenizer)} ({style}, eos "
        f"{tokenizer.eos_token!r}), hidden {args.hidden_size}, {args.layers} layers, "
        f"seed {args.seed}"
    )
    return 0
