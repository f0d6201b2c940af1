"""The records of metrics.jsonl and timeline.jsonl say their type, so that a reader of either
file can tell its lines apart and decode each into its struct (docs/metrics.md)."""

from __future__ import annotations

import json

import msgspec

from pivot.actors.driver import Scores, StepReport
from pivot.timeline import RoleSample, ShiftMark, TimelineRecord


def test_each_line_is_tagged_with_its_type_and_decodes_back():
    sample = RoleSample(t=0.5, role="rollout", tokens_per_s=120.0, outstanding=9)
    mark = ShiftMark(t=0.75, kind="lend_trainer", allocation={"rollout": 3}, seconds=0.1)
    lines = [msgspec.json.encode(sample), msgspec.json.encode(mark)]
    assert [json.loads(line)["type"] for line in lines] == ["sample", "shift"]
    assert json.loads(lines[1])["kind"] == "lend_trainer"  # the tag is not the shift's kind
    decoder = msgspec.json.Decoder(TimelineRecord)
    assert [decoder.decode(line) for line in lines] == [sample, mark]

    report = StepReport(
        step=3,
        policy_version=3,
        samples=2,
        scores=Scores.of([]),
        response_tokens=10,
        judgment_tokens=4,
        started_s=1.0,
        rollout_s=0.5,
        seconds=1.5,
        train_s=0.25,
        samples_per_s=1.3,
        tokens_per_s=9.3,
        rollout_by_replica={"rollout@0": 2},
        reward_by_replica={"reward@1": 2},
    )
    line = msgspec.json.encode(report)
    assert json.loads(line)["type"] == "step"
    assert msgspec.json.decode(line, type=StepReport) == report
