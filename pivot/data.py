"""A job's prompts: records read from a JSONL or Parquet file, and the order a job takes them.

A record is one prompt (a string, or a list of chat messages ``{"role", "content"}``), its
reference answer when the data has one, and every other field of the row as metadata, passed
through untouched to the reward. A bad record is a ``ConfigError`` naming the file, the line
(JSONL) or row (Parquet) and the field, so ``pivot run`` reports it before anything starts.

``RecordStream`` is the order: the records shuffled with the job's seed (one permutation per
epoch, each epoch reshuffled), taken ``prompts_per_step`` at a time as one continuous stream,
so a step may take the end of one epoch and the start of the next. With ``epochs = E`` the
stream ends after E passes and the job runs only the whole steps that fit
(``steps_available``); with ``epochs = 0`` it cycles for as many steps as the job asks.

    read_records(path, prompt_key, reference_key) -> [Record]      raises ConfigError
    RecordStream(records, seed=, shuffle=, epochs=).batch(step, n) -> [Record]
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec

from pivot.config import ConfigError

#: What a chat prompt's messages may say they are.
CHAT_ROLES = ("system", "user", "assistant", "tool")


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt of a data set and what its reward may need."""

    index: int  # its place in the file: 0-based row, for logs and dumps
    prompt: str | list[dict[str, str]]
    reference: Any = None
    metadata: dict[str, Any] = {}

    @property
    def chat(self) -> bool:
        return isinstance(self.prompt, list)

    @property
    def prompt_text(self) -> str:
        """The text a template shows as the question: the prompt, or the last user turn."""
        if isinstance(self.prompt, str):
            return self.prompt
        users = [m["content"] for m in self.prompt if m["role"] == "user"]
        return users[-1] if users else self.prompt[-1]["content"]


def _where(path: Path, row: int, jsonl: bool) -> str:
    return f"{path}:{row + 1}" if jsonl else f"{path} row {row}"


def _prompt(value: Any, where: str, key: str) -> str | list[dict[str, str]]:
    if isinstance(value, str):
        if not value:
            raise ConfigError(where, key, "a non-empty prompt", "an empty string")
        return value
    if isinstance(value, list) and value:
        messages = []
        for i, m in enumerate(value):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise ConfigError(
                    where, f"{key}[{i}]", "a message {role: str, content: str}", _short(m)
                )
            if m["role"] not in CHAT_ROLES:
                raise ConfigError(
                    where, f"{key}[{i}].role", "one of " + ", ".join(CHAT_ROLES), repr(m["role"])
                )
            messages.append({"role": m["role"], "content": m["content"]})
        return messages
    raise ConfigError(where, key, "a string or a non-empty list of chat messages", _short(value))


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:57] + '...' if len(text) > 60 else text}"


def _record(row: Any, index: int, where: str, prompt_key: str, reference_key: str) -> Record:
    if not isinstance(row, dict):
        raise ConfigError(where, "", "a JSON object per line", _short(row))
    if prompt_key not in row:
        fields = ", ".join(sorted(map(str, row))) or "none"
        raise ConfigError(
            where, prompt_key, f"the prompt field (the record has {fields})", "nothing"
        )
    if reference_key and reference_key not in row:
        raise ConfigError(
            where, reference_key, "the reference field (data.reference_key)", "nothing"
        )
    metadata = {k: v for k, v in row.items() if k not in (prompt_key, reference_key)}
    return Record(
        index=index,
        prompt=_prompt(row[prompt_key], where, prompt_key),
        reference=row[reference_key] if reference_key else None,
        metadata=metadata,
    )


def read_records(path: str | Path, prompt_key: str, reference_key: str = "") -> list[Record]:
    """Every record of a ``.jsonl`` or ``.parquet`` file; the first bad one raises."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(str(p), "", "an existing JSONL or Parquet file", "no such file")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(p)
        jsonl = True
    elif suffix == ".parquet":
        rows = _parquet_rows(p)
        jsonl = False
    else:
        raise ConfigError(str(p), "", "a file ending in .jsonl or .parquet", repr(p.suffix))
    records = []
    for row_index, row in rows:
        where = _where(p, row_index, jsonl)
        records.append(_record(row, len(records), where, prompt_key, reference_key))
    if not records:
        raise ConfigError(str(p), "", "at least one record", "none")
    return records


def _jsonl_rows(path: Path):
    decoder = msgspec.json.Decoder()
    with path.open("rb") as f:
        for line_index, line in enumerate(f):
            if not line.strip():
                continue  # a trailing newline or blank line is not a record
            try:
                yield line_index, decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise ConfigError(
                    _where(path, line_index, True), "", "one JSON object", f"invalid JSON ({exc})"
                ) from None


def _parquet_rows(path: Path):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several kinds for a file that is not Parquet
        raise ConfigError(str(path), "", "a Parquet file", f"unreadable ({exc})") from None
    yield from enumerate(table.to_pylist())


class RecordStream:
    """The records in the order a job takes them: seeded, one permutation per epoch."""

    def __init__(
        self, records: list[Record], *, seed: int, shuffle: bool = True, epochs: int = 0
    ) -> None:
        if not records:
            raise ValueError("a stream needs at least one record")
        self.records = records
        self.seed = seed
        self.shuffle = shuffle
        self.epochs = epochs
        self._orders: dict[int, list[int]] = {}

    def steps_available(self, per_step: int) -> int | None:
        """Whole steps of ``per_step`` prompts before the stream ends (None: it never does)."""
        return None if not self.epochs else self.epochs * len(self.records) // per_step

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.records)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # steps move forward: only the current one is kept
        return order

    def batch(self, step: int, per_step: int) -> list[Record]:
        available = self.steps_available(per_step)
        if available is not None and step >= available:
            raise IndexError(f"step {step}: the data ends after {available} steps")
        n = len(self.records)
        first = step * per_step
        return [
            self.records[self._order(position // n)[position % n]]
            for position in range(first, first + per_step)
        ]
