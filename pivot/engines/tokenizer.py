"""The project's character-level tokenizer: built with the `tokenizers` library and saved in
Hugging Face format (tokenizer.json + tokenizer_config.json), so that
``AutoTokenizer.from_pretrained(dir)`` loads it like any checkpoint's tokenizer.

One token per character of a fixed alphabet, plus four special tokens. The tiny models that
``pivot.cli.tinymodels`` makes use it; ``TextCodec`` is the light wrapper the rest of pivot uses to
turn task text into token ids and back without importing transformers.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

# Everything the arithmetic task and its judgments write, plus letters so that odd text still
# maps to real tokens rather than <unk>.
ALPHABET = string.digits + " +-=>:?|.,_\n" + string.ascii_lowercase + string.ascii_uppercase


def build_tokenizer(alphabet: str = ALPHABET) -> Tokenizer:
    """A tokenizer with ids 0..3 for <pad>, <bos>, <eos>, <unk>, then one id per character.

    Encoding with special tokens prepends <bos> (as Llama/Qwen-style tokenizers that add a bos
    do); <eos> is never added: the model generates it.
    """
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # every character is its own pre-token; [\s\S] also matches newlines
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_pretrained(tok: Tokenizer, directory: str | Path, model_max_length: int = 256) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into directory."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
        **specials,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


class TextCodec:
    """Text <-> token ids with a tokenizer.json; knows the bos/eos/pad ids."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        ids = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
        missing = [name for name, i in ids.items() if i is None]
        if missing:
            raise ValueError(f"tokenizer lacks special tokens {missing}")
        self.pad_id: int = ids[PAD]
        self.bos_id: int = ids[BOS]
        self.eos_id: int = ids[EOS]
        self.unk_id: int = ids[UNK]
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, directory: str | Path) -> TextCodec:
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        return cls(Tokenizer.from_file(str(path)))

    has_chat_template = False  # the character tokenizer has none

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=bos).ids

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        """Text of ids, special tokens (bos, eos, pad, unk) left out."""
        return self._tok.decode(list(ids), skip_special_tokens=True)
