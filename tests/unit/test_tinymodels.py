"""The project's tokenizer and its two shipped tiny models: they load through transformers'
Auto classes like any local checkpoint, the torch engine generates what transformers does,
the policy's accuracy matches what the maker recorded, the GenRM agrees with the exact
checker, and the maker itself runs end to end (in a few steps)."""

import json
import random

import pytest
import torch

from pivot import assets, task
from pivot.cli import tinymodels
from pivot.engines.protocol import SamplingParams
from pivot.engines.tokenizer import ALPHABET, TextCodec, build_tokenizer, save_pretrained
from pivot.engines.torch_engine import TorchEngine, generate

ASSETS = assets.ASSETS
POLICY = ASSETS / tinymodels.POLICY_DIR
GENRM = ASSETS / tinymodels.GENRM_DIR


@pytest.fixture(scope="module")
def report():
    return json.loads((ASSETS / tinymodels.REPORT).read_text())


@pytest.fixture(scope="module")
def codec():
    return TextCodec.from_dir(POLICY)


@pytest.fixture(scope="module")
def policy():
    return TorchEngine.from_pretrained(POLICY, max_running=tinymodels.EVAL_SIZE)


def test_tokenizer_round_trip_and_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    save_pretrained(build_tokenizer(), tmp_path)
    codec = TextCodec.from_dir(tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    assert (codec.pad_id, codec.bos_id, codec.eos_id, codec.unk_id) == (0, 1, 2, 3)
    assert (auto.pad_token_id, auto.bos_token_id, auto.eos_token_id) == (0, 1, 2)
    assert codec.vocab_size == 4 + len(ALPHABET) == len(auto)
    p = task.make_problems(0, 1)[0]
    response = task.worked_response(p.prompt)
    texts = [
        p.prompt,
        response,
        task.genrm_prompt(p.prompt, response, p.reference),
        task.ideal_judgment(response, p.reference),
        ALPHABET,
    ]
    for text in texts:
        ids = codec.encode(text)
        assert ids[0] == codec.bos_id and len(ids) == len(text) + 1  # one token per character
        assert codec.decode(ids) == text
        assert auto(text).input_ids == ids
        assert auto.decode(ids, skip_special_tokens=True) == text
    assert codec.encode("a", bos=False) == [codec.encode("a")[1]]
    assert codec.encode("1\u00e92", bos=False)[1] == codec.unk_id  # outside the alphabet
    assert codec.decode(codec.encode("1\u00e92") + [codec.eos_id, codec.pad_id]) == "12"


def test_the_character_tokenizer_gives_each_character_its_id():
    """The shipped models were trained on these ids: <bos>, then one id per character of the
    alphabet, 4 onwards, and <unk> for any other; a special token's text is that token."""
    codec = TextCodec.char()
    rng = random.Random(3)
    chars = ALPHABET + "\u00e9\t\u4e2d<>"
    for n in (0, 1, 2, 50, 400):
        text = "".join(rng.choice(chars) for _ in range(n))
        ids = [4 + ALPHABET.index(c) if c in ALPHABET else codec.unk_id for c in text]
        assert codec.encode(text) == [codec.bos_id, *ids]
        assert codec.encode(text, bos=False) == ids
    assert codec.encode("1<eos>2", bos=False) == [5, codec.eos_id, 6]


def test_shipped_tokenizers_give_the_ids_of_their_tokenizer_json():
    """The shipped folders say qwen2, for which transformers 5's AutoTokenizer would rebuild
    a byte-level BPE from the vocabulary; the codec reads tokenizer.json as it is."""
    from tokenizers import Tokenizer

    in_memory = TextCodec.char()
    texts = ["", " ", "\n\n", "a  b", "1\u00e92 \u4e2d", ALPHABET, ALPHABET[::-1]]
    for p in task.make_problems(11, 40):
        response = task.worked_response(p.prompt)
        texts += [p.prompt, response, task.genrm_prompt(p.prompt, response, p.reference)]
        texts.append(task.ideal_judgment(response, p.reference))
        texts.append(task.ideal_judgment(response[:-1] + "x", p.reference))
    for folder in (POLICY, GENRM):
        raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
        codec = TextCodec.from_dir(folder)
        specials = (codec.pad_id, codec.bos_id, codec.eos_id, codec.unk_id, codec.vocab_size)
        assert specials == (0, 1, 2, 3, raw.get_vocab_size(with_added_tokens=True))
        assert not codec.has_chat_template
        for text in texts:
            for bos in (True, False):
                ids = raw.encode(text, add_special_tokens=bos).ids
                assert codec.encode(text, bos=bos) == in_memory.encode(text, bos=bos) == ids
            ids = raw.encode(text).ids + [codec.eos_id, codec.pad_id]
            assert codec.decode(ids) == raw.decode(ids, skip_special_tokens=True)


def test_shipped_models_load_with_auto_classes(report):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

    total = 0
    for folder in (POLICY, GENRM):
        model = AutoModelForCausalLM.from_pretrained(folder)
        tok = AutoTokenizer.from_pretrained(folder)
        assert isinstance(model, Qwen2ForCausalLM)
        assert model.config.eos_token_id == tok.eos_token_id
        assert model.config.vocab_size == len(tok)
        total += sum(f.stat().st_size for f in folder.iterdir())
    assert total == report["total_bytes"] <= 10 * 2**20


def test_engine_generates_what_transformers_generates(codec, policy):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(POLICY).eval()
    problems = task.make_problems(5, 4)
    outs = generate(
        policy,
        [codec.encode(p.prompt) for p in problems],
        SamplingParams(temperature=0.0, max_new_tokens=32),
    )
    for p, out in zip(problems, outs, strict=True):
        ids = torch.tensor([codec.encode(p.prompt)])
        with torch.no_grad():
            hf = model.generate(ids, max_new_tokens=32, do_sample=False)
        assert list(out.token_ids) == hf[0, ids.shape[1] :].tolist()


def test_policy_accuracy_is_as_recorded_and_weak_but_not_zero(report, codec, policy):
    problems = task.make_problems(tinymodels.EVAL_SEED, tinymodels.EVAL_SIZE)
    greedy = tinymodels.policy_accuracy(policy, codec, problems)
    assert abs(greedy - report["policy"]["eval_greedy_accuracy"]) <= 0.04
    assert 0.05 <= greedy <= 0.8


def test_genrm_agrees_with_the_exact_checker(codec, policy):
    genrm = TorchEngine.from_pretrained(GENRM, max_running=256)
    items = tinymodels.genrm_eval_items(policy, codec, task.make_problems(77, 64), seed=77)
    agreement, malformed = tinymodels.genrm_agreement(genrm, codec, items)
    assert agreement >= 0.95
    assert malformed <= 0.02 * len(items)


def test_maker_runs_end_to_end(tmp_path):
    from transformers import AutoTokenizer

    threads = torch.get_num_threads()
    try:
        report = tinymodels.make_models(
            tmp_path,
            seed=3,
            threads=1,
            policy_max_steps=2,
            genrm_max_steps=2,
            eval_size=8,
            log=lambda line: None,
        )
    finally:
        torch.set_num_threads(threads)
    assert report["seed"] == 3 and report["policy"]["sft_steps"] == 2
    assert json.loads((tmp_path / tinymodels.REPORT).read_text()) == report
    for name in (tinymodels.POLICY_DIR, tinymodels.GENRM_DIR):
        engine = TorchEngine.from_pretrained(tmp_path / name)
        assert engine.spec.vocab_size == len(AutoTokenizer.from_pretrained(tmp_path / name))
