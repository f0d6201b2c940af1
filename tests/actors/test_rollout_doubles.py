"""The test kit's doubles for users' rollout functions (``pivot.actors.rollout_testing``),
driving a user-style multi-turn rollout: a calculator tool between two turns. The same
function runs on the pure ``FakeContext`` and on the real Driver, schedulers and agents
(``run_rollout``), through a scripted shift and a scripted weight update."""

from __future__ import annotations

import pytest

from pivot.actors.testing import (
    Abort,
    FakeContext,
    FakeJudge,
    FakeLLM,
    ScriptError,
    VersionBump,
    make_task,
    run_rollout,
    run_rollouts,
)
from pivot.bus import run_virtual
from pivot.rewards import RewardFailed
from pivot.trajectory import NO_VERSION, Chunk, Trajectory

PROMPT = "What is 17+25?"
CALL, TOOL, ANSWER = "calc 17+25|", " = 42\n", "answer 42"


def llm() -> FakeLLM:
    """The model writes a sum and '|' (it would ramble on: the stop token ends the turn),
    the tool answers, the model concludes."""
    return FakeLLM({PROMPT: CALL + " and so on", "= 42\n": ANSWER})


CODEC = llm().codec


def judge() -> FakeJudge:
    return FakeJudge(lambda response, task: float(response.endswith(f"answer {task.reference}")))


async def calculator(ctx, task):  # noqa: ANN001, ANN201 - a user's rollout function
    bar = ctx.tokenizer.encode("|", bos=False)
    trajectory = Trajectory(prompt_ids=task.prompt_ids)
    call = await ctx.generate(trajectory.token_ids, stop_token_ids=bar)
    trajectory.add_generation(call)
    a, b = call.text.removeprefix("calc ").rstrip("|").split("+")
    trajectory.add_tokens(ctx.tokenizer.encode(f" = {int(a) + int(b)}\n", bos=False))
    trajectory.add_generation(await ctx.generate(trajectory.token_ids))
    return trajectory


def _task(seq_id: int = 0):  # noqa: ANN202
    return make_task(PROMPT, reference="42", codec=CODEC, seq_id=seq_id)


def _ids(text: str) -> list[int]:
    return CODEC.encode(text, bos=False)


def _run(model: FakeLLM | None = None, **kwargs):  # noqa: ANN003, ANN202
    """``run_rollout`` of the calculator on the virtual clock."""
    model = model or llm()
    return run_virtual(
        lambda clock: run_rollout(calculator, _task(), llm=model, clock=clock, **kwargs)
    )


async def test_the_calculator_rollout_is_token_exact_with_its_tool_tokens_masked():
    ctx = FakeContext(_task(), llm())
    trajectory = await calculator(ctx, _task())
    assert trajectory.response_ids == _ids(CALL) + _ids(TOOL) + _ids(ANSWER)
    mask = [1] * len(CALL) + [0] * len(TOOL) + [1] * len(ANSWER)
    assert trajectory.loss_mask == mask
    assert trajectory.logprobs == [-0.5 if m else 0.0 for m in mask]
    assert trajectory.versions == [0 if m else NO_VERSION for m in mask]
    assert [c.finish_reason.value for c in ctx.calls] == ["stop", "stop"]
    # the second turn's prompt is the whole first turn and the tool's answer
    assert ctx.calls[1].prompt_ids == [*_task().prompt_ids, *_ids(CALL + TOOL)]

    # as a user's async test awaits it: on the running loop, wall time
    result = await run_rollout(calculator, _task(), llm=llm(), judge=judge())
    assert result.trajectories == [trajectory]  # the real path gives the pure double's tokens
    assert [c.chunks for c in result.calls] == [[Chunk(len(CALL), 0)], [Chunk(len(ANSWER), 0)]]
    assert result.rewards == [1.0]


def test_a_shift_in_the_middle_of_the_second_turn_is_invisible_to_the_rollout():
    plain = _run()
    model = llm()
    shifted = _run(model, aborts=[Abort(call=1, after_tokens=4)])
    [struck] = shifted.struck
    assert struck.tokens == 4 and struck.seq_id != shifted.task.seq_id
    # the second call finished on another replica, which re-prefilled the first one's tokens
    assert shifted.calls[1].replica != struck.replica
    assert model.prefills == [(0, 0), (struck.seq_id, 0), (struck.seq_id, 4)]
    assert shifted.trajectories == plain.trajectories  # same tokens, logprobs, mask, versions
    for before, after in zip(plain.calls, shifted.calls, strict=True):
        assert (before.token_ids, before.logprobs, before.chunks) == (
            after.token_ids,
            after.logprobs,
            after.chunks,
        )
    # each call's sequence submitted once and done once (the kit also checked ownership)
    assert shifted.sequences == {"rollout": {"submitted": 2, "done": 2, "queued": 0, "running": 0}}
    assert shifted.report.duplicates == 0 and shifted.report.samples == 1


def test_many_rollouts_through_several_shifts_keep_every_sequence_owned_once():
    tasks = [_task(i) for i in range(6)]
    aborts = [
        Abort(call=c, after_tokens=t, task=i) for i, c, t in [(0, 0, 3), (2, 1, 2), (5, 1, 6)]
    ]

    async def main(clock):  # noqa: ANN001, ANN202
        return await run_rollouts(calculator, tasks, llm=llm(), aborts=aborts, clock=clock)

    results = run_virtual(main)
    expected = run_virtual(calculator(FakeContext(tasks[0], llm()), tasks[0]))
    assert all(r.trajectories == [expected] for r in results)
    assert sorted(s.task for r in results for s in r.struck) == [0, 2, 5]
    counts = results[0].sequences["rollout"]
    assert counts == {"submitted": 12, "done": 12, "queued": 0, "running": 0}


async def test_a_script_keys_by_the_prompts_end_text_or_ids_or_is_a_function_of_the_seed():
    task = _task()
    keyed = FakeLLM({"17+25?": "short", PROMPT: "long", (9, 9): [5, 6]}, default="?")
    ctx = FakeContext(task, keyed)
    assert (await ctx.generate(task.prompt_ids)).text == "long"  # the longest key that fits
    assert (await ctx.generate([*task.prompt_ids, 9, 9])).token_ids == [5, 6]
    assert (await ctx.generate("anything")).text == "?"
    seeded = FakeLLM(lambda prompt, sampling: f"seed {sampling.seed % 1000}")
    ctx = FakeContext(task, seeded)
    texts = [(await ctx.generate(task.prompt_ids)).text for _ in range(2)]
    # the first call has the task's seed, the next one a seed derived from it, as in a job
    assert texts[0] == f"seed {task.sampling.seed}" and texts[1] != texts[0]
    assert len(ctx.calls) == 2
    ctx.end_session()  # a multi-turn rollout's, as in a job (nothing to release here)
    ctx.finish()


def test_a_version_bump_mid_call_splits_its_chunks_and_later_calls_carry_it():
    bump = VersionBump(call=0, after_tokens=3, version=1)
    result = _run(versions=[bump])
    first, second = result.calls
    assert first.chunks == [Chunk(3, 0), Chunk(len(CALL) - 3, 1)]
    assert second.chunks == [Chunk(len(ANSWER), 1)]
    versions = result.trajectories[0].versions
    assert versions == [0] * 3 + [1] * (len(CALL) - 3) + [NO_VERSION] * len(TOOL) + [1] * len(
        ANSWER
    )
    # the pure double splits the same way
    ctx = FakeContext(_task(), llm(), versions=[bump])
    assert run_virtual(calculator(ctx, _task())).versions == versions
    assert ctx.policy_version == 1 and not ctx.unstruck


def test_the_judge_is_reached_by_ctx_judge_and_by_the_jobs_default_scoring():
    async def judged_twice(ctx, task):  # noqa: ANN001, ANN202
        own = await calculator(ctx, task)
        own.reward = await ctx.judge(own)  # the rollout scores this segment itself
        wrong = await ctx.generate(task.prompt_ids, max_new_tokens=4)  # "calc": no answer
        return [own, Trajectory.of(wrong)]  # the job scores this one

    result = run_virtual(
        lambda clock: run_rollout(judged_twice, _task(), llm=llm(), judge=judge(), clock=clock)
    )
    assert result.rewards == [1.0, 0.0]
    by = {j.by: j for j in result.judgments}
    assert set(by) == {"ctx.judge", "job"}
    assert by["ctx.judge"].response == CALL + TOOL + ANSWER
    assert by["ctx.judge"].text == "score: 1.0" and by["job"].score == 0.0
    assert by["job"].response == "calc"

    ctx = FakeContext(_task(), llm(), judge())
    segments = run_virtual(judged_twice(ctx, _task()))
    assert segments[0].reward == 1.0 and [j.score for j in ctx.judgments] == [1.0]


def test_a_judge_without_a_verdict_fails_the_reward_as_a_genrm_would():
    silent = FakeJudge({}, default=None)

    async def asks(ctx, task):  # noqa: ANN001, ANN202
        trajectory = await calculator(ctx, task)
        with pytest.raises(RewardFailed):
            await ctx.judge(trajectory)
        return trajectory

    result = run_virtual(
        lambda clock: run_rollout(asks, _task(), llm=llm(), judge=silent, clock=clock)
    )
    assert result.rewards == [None]
    assert [(j.by, j.failure) for j in result.judgments] == [
        ("ctx.judge", "unparseable judgment"),
        ("job", "unparseable judgment"),
    ]


def test_a_prompt_the_script_does_not_know_is_one_clear_error():
    unknown = FakeLLM({"something else": "x"})
    with pytest.raises(ScriptError) as raised:
        run_virtual(lambda clock: run_rollout(calculator, _task(), llm=unknown, clock=clock))
    assert str(raised.value) == f"FakeLLM has no output for the prompt {PROMPT!r}"
    with pytest.raises(ScriptError, match="no output for the prompt 'What is 17"):
        run_virtual(calculator(FakeContext(_task(), unknown), _task()))


def test_an_event_that_never_strikes_and_a_rollout_that_raises_are_reported():
    with pytest.raises(ScriptError, match="never struck: Abort\\(call=2"):
        _run(aborts=[Abort(call=2, after_tokens=1)])  # the rollout makes two calls

    async def broken(ctx, task):  # noqa: ANN001, ANN202
        await ctx.generate(task.prompt_ids)
        raise KeyError("the user's bug")

    with pytest.raises(KeyError, match="the user's bug"):
        run_virtual(lambda clock: run_rollout(broken, _task(), llm=llm(), clock=clock))


def test_a_judge_whose_score_raises_stops_the_run_with_one_error():
    def buggy(response, task):  # noqa: ANN001, ANN202
        return {"no": 1}[response]

    with pytest.raises(ScriptError, match="FakeJudge's score failed on the response .*KeyError"):
        _run(judge=FakeJudge(buggy))
