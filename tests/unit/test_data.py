"""A job's prompts from files: records, their errors (file, line, field), and the seeded
order a job takes them in."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from pivot.config import ConfigError
from pivot.data import RecordStream, read_records


def _jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_records_carry_prompt_reference_and_the_rest_as_metadata(tmp_path):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    path = _jsonl(
        tmp_path / "d.jsonl",
        [
            {"question": "1+1=", "answer": "2", "source": "gsm", "level": 3},
            {"question": chat, "answer": 4},
        ],
    )
    first, second = read_records(path, "question", "answer")
    assert (first.prompt, first.reference, first.metadata) == (
        "1+1=",
        "2",
        {"source": "gsm", "level": 3},
    )
    assert not first.chat and first.prompt_text == "1+1="
    assert second.chat and second.prompt == chat and second.prompt_text == "2+2?"
    assert second.reference == 4 and (first.index, second.index) == (0, 1)
    # without a reference key, every other field is metadata
    assert read_records(path, "question")[0].metadata["answer"] == "2"


def test_parquet_reads_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "ref": ["1", "2"], "id": [7, 8]}), path)
    records = read_records(path, "prompt", "ref")
    assert [(r.prompt, r.reference, r.metadata) for r in records] == [
        ("a", "1", {"id": 7}),
        ("b", "2", {"id": 8}),
    ]
    with pytest.raises(ConfigError, match=r"row 1: key 'prompt'"):
        pq.write_table(pa.table({"prompt": ["a", None]}), path)
        read_records(path, "prompt")


@pytest.mark.parametrize(
    "rows, keys, where",
    [
        (
            [{"p": "x"}, {"q": "y"}],
            ("p", ""),
            r"d\.jsonl:2: key 'p': expected the prompt field \(the record has q\)",
        ),
        ([{"p": "x"}, "{not json"], ("p", ""), r"d\.jsonl:2: expected one JSON object"),
        ([{"p": "x"}, [1, 2]], ("p", ""), r"d\.jsonl:2: expected a JSON object per line"),
        ([{"p": ""}], ("p", ""), r"d\.jsonl:1: key 'p': expected a non-empty prompt"),
        ([{"p": 5}], ("p", ""), r"d\.jsonl:1: key 'p': expected a string or a non-empty list"),
        ([{"p": [{"role": "user"}]}], ("p", ""), r"key 'p\[0\]': expected a message"),
        ([{"p": [{"role": "bot", "content": "x"}]}], ("p", ""), r"key 'p\[0\]\.role'"),
        (
            [{"p": "x"}, {"p": "y", "r": 1}],
            ("p", "r"),
            r"d\.jsonl:1: key 'r': expected the reference",
        ),
        ([], ("p", ""), r"expected at least one record"),
    ],
)
def test_a_bad_record_names_the_file_the_line_and_the_field(tmp_path, rows, keys, where):
    path = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ConfigError, match=where):
        read_records(path, *keys)


def test_a_missing_or_unknown_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        read_records(tmp_path / "nope.jsonl", "p")
    (tmp_path / "d.csv").write_text("p\nx\n")
    with pytest.raises(ConfigError, match=r"expected a file ending in \.jsonl or \.parquet"):
        read_records(tmp_path / "d.csv", "p")


def test_blank_lines_are_not_records(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"p": "a"}\n\n{"p": "b"}\n\n')
    assert [r.prompt for r in read_records(path, "p")] == ["a", "b"]


def _stream(n: int, **kw) -> RecordStream:
    from pivot.data import Record

    return RecordStream([Record(index=i, prompt=str(i)) for i in range(n)], **kw)


def test_each_epoch_is_a_seeded_permutation_and_steps_run_across_epochs():
    stream = _stream(10, seed=3)
    taken = [r.index for step in range(5) for r in stream.batch(step, 4)]  # 20 = two epochs
    assert Counter(taken[:10]) == Counter(range(10)) == Counter(taken[10:])
    assert taken[:10] != taken[10:]  # each epoch reshuffled
    assert taken[:10] != list(range(10))
    again = _stream(10, seed=3)
    assert [r.index for r in again.batch(3, 4)] == taken[12:16]  # any step, any order
    assert [r.index for r in _stream(10, seed=4).batch(0, 4)] != taken[:4]
    assert [r.index for r in _stream(10, seed=3, shuffle=False).batch(2, 4)] == [8, 9, 0, 1]


def test_epochs_end_the_stream_after_the_whole_steps_that_fit():
    stream = _stream(10, seed=0, epochs=2)
    assert stream.steps_available(4) == 5 and stream.steps_available(3) == 6
    assert _stream(10, seed=0).steps_available(4) is None  # cycles
    stream.batch(4, 4)
    with pytest.raises(IndexError, match="ends after 5 steps"):
        stream.batch(5, 4)
