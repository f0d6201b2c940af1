"""Where a Driver's sequences come from and how they are judged: the real arithmetic task on
tiny models (``TaskSource``), or a simulated workload whose lengths are drawn from a model
group's distributions (``WorkloadSource``). The Driver's loop is the same for both.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from pivot.actors.messages import Completion, Placeholders, RLMessage, TokenIds, Work
from pivot.actors.trainer_messages import SimTrainBatch, TrainBatch
from pivot.engines.protocol import SamplingParams
from pivot.engines.tokenizer import TextCodec
from pivot.task import (
    JudgmentTally,
    Problem,
    genrm_prompt,
    is_correct,
    make_problems,
    parse_judgment,
)


class Sample(msgspec.Struct, kw_only=True):
    """One sequence of a step as the Driver tracks it through rollout, judging and scoring."""

    seq_id: int
    group: int
    prompt_ids: TokenIds
    response: Completion | None = None
    judgment: Completion | None = None
    score: float | None = None
    correct: bool | None = None  # the exact checker, when the source has one
    malformed: bool = False  # the judgment had no readable verdict (scored 0)


class Source(Protocol):
    judged: bool  # whether responses go to a GenRM

    def batch(self, step: int, policy_version: int) -> list[tuple[Sample, Work]]: ...

    def judge(self, sample: Sample) -> Work:
        """The GenRM sequence judging ``sample.response`` (same id)."""
        ...

    def check(self, sample: Sample) -> bool | None:
        """The exact checker's verdict on the response, if the source has one."""
        ...

    def score(self, sample: Sample) -> float:
        """The reward: from the judgment when judged, else from the exact check."""
        ...

    def train_request(self, step: int, samples: list[Sample]) -> RLMessage: ...


class TaskSource:
    """The project's arithmetic task: problems from a seed, prompts x samples each.

    ``codec`` is the policy's tokenizer, ``judge_codec`` the GenRM's (default: the same): a
    response reaches the GenRM as text, and its judging prompt is encoded, and its judgment
    decoded, with the GenRM's own tokenizer."""

    def __init__(
        self,
        codec: TextCodec,
        *,
        seed: int,
        prompts_per_step: int,
        samples_per_prompt: int,
        sampling: SamplingParams,
        judged: bool,
        judgment_tokens: int = 24,
        judge_codec: TextCodec | None = None,
    ) -> None:
        self.codec = codec
        self.judge_codec = judge_codec or codec
        self.seed = seed
        self.prompts_per_step = prompts_per_step
        self.samples_per_prompt = samples_per_prompt
        self.sampling = sampling
        self.judged = judged
        self.judgment_tokens = judgment_tokens
        self.tally = JudgmentTally()
        # per sequence until it is scored (a Driver with staleness has several batches out)
        self._problems: dict[int, Problem] = {}
        self._texts: dict[int, str] = {}

    def batch(self, step: int, policy_version: int) -> list[tuple[Sample, Work]]:
        problems = make_problems(self.seed * 7919 + step, self.prompts_per_step)
        out = []
        for i, problem in enumerate(problems):
            prompt_ids = self.codec.encode(problem.prompt)
            group = step * len(problems) + i
            for j in range(self.samples_per_prompt):
                seq_id = group * self.samples_per_prompt + j
                self._problems[seq_id] = problem
                sampling = msgspec.structs.replace(
                    self.sampling, seed=self.seed * 1_000_003 + seq_id
                )
                out.append(
                    (
                        Sample(seq_id=seq_id, group=group, prompt_ids=prompt_ids),
                        Work(
                            seq_id=seq_id,
                            prompt_ids=prompt_ids,
                            sampling=sampling,
                            policy_version=policy_version,
                        ),
                    )
                )
        return out

    def _text(self, sample: Sample) -> str:
        text = self._texts.get(sample.seq_id)
        if text is None:
            assert sample.response is not None
            text = self._texts[sample.seq_id] = self.codec.decode(sample.response.token_ids)
        return text

    def check(self, sample: Sample) -> bool | None:
        return is_correct(self._text(sample), self._problems[sample.seq_id].reference)

    def judge(self, sample: Sample) -> Work:
        problem = self._problems[sample.seq_id]
        prompt = genrm_prompt(problem.prompt, self._text(sample), problem.reference)
        return Work(
            seq_id=sample.seq_id,
            prompt_ids=self.judge_codec.encode(prompt),
            sampling=SamplingParams(max_new_tokens=self.judgment_tokens, temperature=0.0),
        )

    def score(self, sample: Sample) -> float:
        self._problems.pop(sample.seq_id, None)  # the last call about this sequence
        self._texts.pop(sample.seq_id, None)
        if not self.judged:
            return float(bool(sample.correct))
        assert sample.judgment is not None
        text = self.judge_codec.decode(sample.judgment.token_ids)
        judgment = self.tally.add(parse_judgment(text))
        sample.malformed = judgment.malformed
        return judgment.score

    def train_request(self, step: int, samples: list[Sample]) -> RLMessage:
        from pivot.training import RolloutSample

        return TrainBatch(
            step=step,
            samples=[
                RolloutSample(
                    prompt_ids=s.prompt_ids,
                    response_ids=s.response.token_ids,
                    logprobs=s.response.logprobs,
                    reward=float(s.score or 0.0),
                    group=s.group,
                )
                for s in samples
                if s.response is not None
            ],
        )


class WorkloadSource:
    """A simulated model group: token ids are ``Placeholders``, only lengths are real. Responses
    and judgments run exactly as long as the workload's seeded draw says. Responses of any
    batch in flight can be judged (a Driver with staleness runs several)."""

    judged = True

    def __init__(self, workload, *, seed: int) -> None:
        from pivot.workload import Workload

        assert isinstance(workload, Workload)
        self.workload = workload
        self.sampler = workload.sampler(seed)
        # sequence -> (GenRM prompt tokens, judgment tokens), until it is judged
        self._judgments: dict[int, tuple[int, int]] = {}

    def batch(self, step: int, policy_version: int) -> list[tuple[Sample, Work]]:
        from pivot.engines.sim_engine import sim_sampling

        lengths = self.sampler.step(step)
        n = lengths.sequences
        first = step * n
        prompts = lengths.prompt_tokens.size
        per_prompt = lengths.samples_per_prompt
        out = []
        for i, (prompt, response, truncated, genrm_tokens, judgment_tokens) in enumerate(
            zip(
                lengths.sequence_prompt_tokens.tolist(),
                lengths.response_tokens.tolist(),
                lengths.response_truncated.tolist(),
                lengths.genrm_prompt_tokens.tolist(),
                lengths.judgment_tokens.tolist(),
                strict=True,
            )
        ):
            seq_id = first + i
            prompt_ids = Placeholders(prompt)
            self._judgments[seq_id] = (genrm_tokens, judgment_tokens)
            out.append(
                (
                    Sample(
                        seq_id=seq_id, group=step * prompts + i // per_prompt, prompt_ids=prompt_ids
                    ),
                    Work(
                        seq_id=seq_id,
                        prompt_ids=prompt_ids,
                        sampling=sim_sampling(response, truncated=truncated),
                        policy_version=policy_version,
                    ),
                )
            )
        return out

    def check(self, sample: Sample) -> bool | None:
        return None

    def judge(self, sample: Sample) -> Work:
        from pivot.engines.sim_engine import sim_sampling

        genrm_tokens, judgment_tokens = self._judgments.pop(sample.seq_id)
        return Work(
            seq_id=sample.seq_id,
            prompt_ids=Placeholders(genrm_tokens),
            sampling=sim_sampling(judgment_tokens),
        )

    def score(self, sample: Sample) -> float:
        return 0.0  # a simulated judgment has no verdict; throughput is what is measured

    def train_request(self, step: int, samples: list[Sample]) -> RLMessage:
        tokens = sum(len(s.prompt_ids) + len(s.response.token_ids) for s in samples if s.response)
        return SimTrainBatch(step=step, sequences=len(samples), tokens=tokens)
