"""Text <-> token ids for pivot: ``TextCodec``, a thin wrapper over the model's own
``transformers`` tokenizer (``AutoTokenizer``), with its special tokens and its chat template;
and the project's character-level tokenizer, which the shipped tiny models use.

    TextCodec.from_dir(folder)    the folder's tokenizer; a TokenizerError names the file
    TextCodec(hf_tokenizer)       one already loaded (or built in memory)
    TextCodec.char(alphabet)      the character tokenizer, in memory (tests, the tiny maker)
    load_tokenizer(folder)        the transformers tokenizer itself

The character tokenizer is built with the `tokenizers` library and saved in Hugging Face format
(tokenizer.json + tokenizer_config.json): one token per character of a fixed alphabet, plus four
special tokens. transformers is imported only when a codec is made, so that importing this
module stays cheap for the processes that only pass ids around.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, processors

from pivot.config import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

# Everything the arithmetic task and its judgments write, plus letters so that odd text still
# maps to real tokens rather than <unk>.
ALPHABET = string.digits + " +-=>:?|.,_\n" + string.ascii_lowercase + string.ascii_uppercase

# Files one of which a folder needs for transformers to have a vocabulary to read: without any,
# a model-specific class (Qwen2Tokenizer, say) builds a near-empty default instead of failing.
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tekken.json", "tiktoken.model")

# The class names that mean "tokenizer.json as it is" (transformers 5 names the second).
GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


class TokenizerError(ConfigError):
    """A tokenizer folder pivot cannot use: the file, what pivot needs and what was found
    (``str()`` is the one line to show)."""


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
    # BPE without merges: the whole text is one word, and each character stays a token. A
    # WordLevel model behind a pre-tokenizer that splits every character gives the same ids
    # at three times the cost (75 against 30 us for a 50-character judge prompt, which the
    # Driver encodes on its loop)
    tok = Tokenizer(models.BPE(vocab, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def char_tokenizer(
    alphabet: str = ALPHABET, model_max_length: int = 256
) -> PreTrainedTokenizerFast:
    """The character tokenizer as a transformers tokenizer, built in memory (no chat template)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(alphabet),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def load_tokenizer(directory: str | Path) -> PreTrainedTokenizerBase:
    """The folder's own tokenizer, as ``AutoTokenizer`` loads it, from local files only.

    One exception: a folder whose tokenizer_config.json names the generic fast class gets
    exactly its tokenizer.json. transformers 5 otherwise substitutes its own class for some
    model types (Qwen2's among them), which rebuilds a byte-level BPE from the vocabulary and
    would silently give other ids for pivot's character tokenizer.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = Path(directory)
    config_path = folder / "tokenizer_config.json"
    if not folder.is_dir():
        raise TokenizerError(str(folder), "", "a model folder", "no such folder")
    if not any((folder / name).is_file() for name in VOCAB_FILES):
        raise TokenizerError(
            str(folder / "tokenizer.json"), "", f"a tokenizer ({' or '.join(VOCAB_FILES)})", "none"
        )
    tok_config: dict = {}
    if config_path.is_file():
        try:
            tok_config = json.loads(config_path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise TokenizerError(str(config_path), "", "a JSON object", _first_line(exc)) from None
        if not isinstance(tok_config, dict):
            raise TokenizerError(str(config_path), "", "a JSON object", type(tok_config).__name__)
    generic = tok_config.get("tokenizer_class") in GENERIC_CLASSES
    loader = PreTrainedTokenizerFast if generic else AutoTokenizer
    try:
        return loader.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers and tokenizers raise many kinds; all mean "cannot load"
        json_path = folder / "tokenizer.json"
        culprit = json_path if json_path.is_file() and _unreadable(json_path) else folder
        raise TokenizerError(
            str(culprit), "", "a tokenizer AutoTokenizer loads", _first_line(exc)
        ) from None


def _unreadable(path: Path) -> bool:
    try:
        Tokenizer.from_file(str(path))
    except Exception:  # the tokenizers library raises a bare Exception on a bad file
        return True
    return False


class TextCodec:
    """Text <-> token ids with a model's own transformers tokenizer: its special tokens (read
    from it, none required by name) and its chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.eos_id: int | None = tokenizer.eos_token_id
        self.bos_id: int | None = tokenizer.bos_token_id
        self.pad_id: int | None = tokenizer.pad_token_id
        self.unk_id: int | None = tokenizer.unk_token_id
        self.vocab_size: int = len(tokenizer)

    @classmethod
    def from_dir(cls, directory: str | Path) -> TextCodec:
        """The folder's tokenizer (``load_tokenizer``); one without an eos token is refused,
        since generation could never stop."""
        codec = cls(load_tokenizer(directory))
        if codec.eos_id is None:
            raise TokenizerError(
                str(Path(directory) / "tokenizer_config.json"),
                "eos_token",
                "an eos token (generation stops there)",
                "none",
            )
        return codec

    @classmethod
    def char(cls, alphabet: str = ALPHABET) -> TextCodec:
        """The project's character tokenizer, in memory."""
        return cls(char_tokenizer(alphabet))

    @property
    def padding_id(self) -> int:
        """What batches are padded with: pad, else eos (masked out anyway), else 0."""
        for i in (self.pad_id, self.eos_id):
            if i is not None:
                return i
        return 0

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Ids of text; with ``bos`` the special tokens the tokenizer itself adds (a bos for
        Llama-style tokenizers, nothing for Qwen-style ones), without it none."""
        return list(self.tokenizer.encode(text, add_special_tokens=bos))

    def _need_template(self) -> None:
        if not self.has_chat_template:
            name = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
            raise ValueError(
                f"tokenizer {name!r} has no chat template (tokenizer_config.json "
                "'chat_template' or chat_template.jinja): give plain text prompts instead"
            )

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The text the chat template makes of messages."""
        self._need_template()
        return self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def encode_chat(
        self, messages: Sequence[dict], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Ids of messages through the chat template. The template writes any bos itself, so
        the rendered text is encoded without adding special tokens again."""
        self._need_template()
        return list(
            self.tokenizer.apply_chat_template(
                list(messages),
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,  # transformers 5 returns a BatchEncoding by default
            )
        )

    def decode(self, ids: Sequence[int], *, special: bool = False) -> str:
        """Text of ids, special tokens (bos, eos, pad, ...) left out unless ``special``
        (then the text is what a chat template writes for them)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=not special)
