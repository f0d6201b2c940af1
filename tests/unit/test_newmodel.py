"""User-style models (pivot.cli.newmodel): a byte-level BPE tokenizer with real-model special
tokens and a chat template, random-weight Llama/Qwen3 checkpoints that transformers and
pivot's engine both load, pivot's ``TextCodec`` over them, and ``pivot new-model``."""

from __future__ import annotations

import json

import pytest
import torch

from pivot.cli import newmodel
from pivot.cli.main import main as pivot_main
from pivot.config import ConfigError
from pivot.engines.checkpoint import inspect_checkpoint
from pivot.engines.protocol import SamplingParams
from pivot.engines.tokenizer import SPECIAL_TOKENS, TextCodec
from pivot.engines.torch_engine import TorchEngine, generate

TEXTS = [
    "47+85=",
    "7+5+0=12 4+8+1=13 >132",
    "The quick brown fox jumps over the lazy dog.\n  Twice.",
    "unicode: é, 中文, emoji \U0001f600, tab\tand trailing space ",
]
CHAT = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 47+85?"},
]


@pytest.fixture(scope="module")
def tokenizers():
    corpus = newmodel.default_corpus()
    return {
        "llama3": newmodel.byte_level_bpe(corpus, 512, style="llama3"),
        "chatml": newmodel.byte_level_bpe(corpus, 400, style="chatml"),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizers):
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": newmodel.random_checkpoint(root / "llama", "llama", tokenizers["llama3"]),
        "qwen3": newmodel.random_checkpoint(root / "qwen3", "qwen3", tokenizers["chatml"]),
    }


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_tokenizer_round_trips_with_real_model_special_tokens(tokenizers, style):
    tok = tokenizers[style]
    vocab = tok.get_vocab()
    assert not set(SPECIAL_TOKENS) & set(vocab)  # none of pivot's character-tokenizer names
    assert len(tok) == {"llama3": 512, "chatml": 400}[style]
    assert tok.eos_token == newmodel.STYLES[style]["eos"] and tok.chat_template
    specials = newmodel.STYLES[style]["specials"]
    assert sorted(vocab[s] for s in specials) == list(range(len(tok) - len(specials), len(tok)))
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert len(ids) < len(text.encode())  # merges were learnt: not one id per byte
    with_specials = tok.encode(TEXTS[0])
    if style == "llama3":
        assert with_specials[0] == tok.bos_token_id == vocab["<|begin_of_text|>"]
    else:
        assert tok.bos_token_id is None and tok.pad_token == "<|endoftext|>"
        assert with_specials == tok.encode(TEXTS[0], add_special_tokens=False)
    again = newmodel.byte_level_bpe(newmodel.default_corpus(), len(tok), style=style)
    assert again.get_vocab() == vocab


def test_tokenizer_vocab_too_small_is_refused():
    with pytest.raises(ValueError, match="at least 259"):
        newmodel.byte_level_bpe(["abc"], 100)


@pytest.mark.parametrize(
    ("family", "style", "cls"),
    [("llama", "llama3", "LlamaForCausalLM"), ("qwen3", "chatml", "Qwen3ForCausalLM")],
)
def test_random_checkpoint_loads_in_transformers_and_in_pivot(
    checkpoints, tokenizers, family, style, cls
):
    from transformers import AutoModelForCausalLM

    from pivot.cli.run import check_model

    folder, tok = checkpoints[family], tokenizers[style]
    assert (folder / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(model).__name__ == cls
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id
    spec, files = inspect_checkpoint(folder)
    assert (spec.model_type, spec.vocab_size, spec.eos_token_ids) == (
        family,
        len(tok),
        (tok.eos_token_id,),
    )
    assert spec.qk_norm == (family == "qwen3")
    assert [f.name for f in files] == ["model.safetensors"]

    codec = TextCodec.from_dir(folder)
    assert (codec.eos_id, codec.bos_id, codec.pad_id) == (
        tok.eos_token_id,
        tok.bos_token_id,
        tok.pad_token_id,
    )
    assert codec.vocab_size == len(tok) and codec.has_chat_template
    assert codec.padding_id == (tok.pad_token_id if family == "qwen3" else tok.eos_token_id)
    for text in TEXTS:
        assert codec.encode(text) == tok.encode(text)
        assert codec.decode(codec.encode(text) + [codec.eos_id]) == text
    check_model(folder)  # pivot run takes it: no pivot special tokens needed

    prompt = codec.encode_chat(CHAT)
    [out] = generate(
        TorchEngine.from_pretrained(folder),
        [prompt],
        SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True),
    )
    with torch.no_grad():
        hf = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )
    assert list(out.token_ids) == hf[0, len(prompt) :].tolist()


def test_same_seed_same_weights(tmp_path, tokenizers):
    from safetensors.torch import load_file

    tok = tokenizers["chatml"]
    state = torch.random.get_rng_state()
    folders = [
        newmodel.random_checkpoint(tmp_path / name, "qwen3", tok, seed=seed)
        for name, seed in (("a", 7), ("b", 7), ("c", 8))
    ]
    weights = [load_file(f / "model.safetensors") for f in folders]
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG untouched
    a, b, c = weights
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_encode_chat_is_what_apply_chat_template_gives(checkpoints, family):
    from transformers import AutoTokenizer

    folder = checkpoints[family]
    codec, auto = TextCodec.from_dir(folder), AutoTokenizer.from_pretrained(folder)
    for gen in (True, False):
        ids = auto.apply_chat_template(
            CHAT, add_generation_prompt=gen, tokenize=True, return_dict=False
        )
        text = auto.apply_chat_template(CHAT, add_generation_prompt=gen, tokenize=False)
        assert codec.encode_chat(CHAT, add_generation_prompt=gen) == list(ids)
        assert codec.render_chat(CHAT, add_generation_prompt=gen) == text
        assert CHAT[1]["content"] in text and ("assistant" in text) == gen  # the header
    ids = codec.encode_chat(CHAT)
    if codec.bos_id is not None:  # the template writes the bos; it is not added again
        assert ids[0] == codec.bos_id and ids.count(codec.bos_id) == 1
    assert ids.count(codec.eos_id) == len(CHAT)  # each finished turn ends with the eos
    with pytest.raises(Exception, match="roles are system, user and assistant"):
        codec.encode_chat([{"role": "tool", "content": "x"}])


def test_a_codec_without_a_chat_template_says_so():
    codec = TextCodec.char()
    assert not codec.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        codec.encode_chat(CHAT)
    with pytest.raises(ValueError, match="no chat template"):
        codec.render_chat(CHAT)


def test_a_tokenizer_bigger_than_the_model_is_named(tmp_path, tokenizers):
    from pivot.cli.run import check_model

    folder = newmodel.random_checkpoint(tmp_path / "m", "qwen3", tokenizers["chatml"])
    tokenizers["llama3"].save_pretrained(folder)  # 512 tokens for a 400-row embedding
    with pytest.raises(ConfigError, match="tokenizer.json: expected at most 400 tokens"):
        check_model(folder)


def test_new_model_command_writes_a_model_and_names_bad_input(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in newmodel.default_corpus()) + "\n")
    out = tmp_path / "m"
    args = ["new-model", str(out), "--family", "mistral", "--vocab-size", "300", "--seed", "3"]
    assert pivot_main([*args, "--corpus", str(corpus)]) == 0
    assert "mistral" in capsys.readouterr().out
    spec, _ = inspect_checkpoint(out)
    assert (spec.model_type, spec.vocab_size) == ("mistral", 300)
    assert TextCodec.from_dir(out).eos_id == spec.eos_token_ids[0]

    with pytest.raises(SystemExit) as exit_:
        pivot_main(["new-model", str(tmp_path / "x"), "--family", "gpt2"])
    [line] = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and "--family" in line and "'gpt2'" in line

    corpus.write_text('{"text": "fine"}\n{"txt": 3}\n')
    args = ["new-model", str(tmp_path / "y"), "--family", "llama", "--corpus", str(corpus)]
    assert pivot_main(args) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"pivot: config error: {corpus}:2: expected") and '"text"' in line
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
