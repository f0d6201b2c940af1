"""The OpenAI-compatible gateway driven by the real ``openai`` client, over a scripted policy
that spells its replies one character per token: ids the tokenizer would never cut that way,
so a trajectory that re-tokenized any text would be caught."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import openai
import pytest
from openai import AsyncOpenAI

from pivot.actors.gateway import DEFAULT_MODEL, Gateway
from pivot.cli.newmodel import byte_level_bpe, default_corpus
from pivot.engines.protocol import FinishReason
from pivot.engines.tokenizer import TextCodec
from pivot.trajectory import Chunk, Generation

VERSION = 3


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    # a byte-level BPE with a ChatML template: the tiny policy's tokenizer has no template
    return TextCodec(byte_level_bpe(default_corpus(), 512, style="chatml"))


@pytest.fixture
async def gateway(codec) -> AsyncIterator[Gateway]:
    async with Gateway(codec) as gw:
        yield gw


class ScriptedPolicy:
    """``ctx.generate`` over scripted replies: each call answers the next one, one token per
    character and then the eos, cut at a stop token or at ``max_new_tokens`` (an exception
    in the script is raised instead)."""

    def __init__(self, codec: TextCodec, replies: Sequence[str | Exception]) -> None:
        self.codec, self.replies = codec, list(replies)
        self.calls: list[tuple[list[int], dict]] = []
        self.generations: list[Generation] = []
        self.hold: asyncio.Event | None = None  # when given, calls wait for it
        self._called = asyncio.Condition()

    async def called(self, n: int) -> None:
        """Return once ``n`` calls have arrived."""
        async with self._called:
            await self._called.wait_for(lambda: len(self.calls) >= n)

    def spelt(self, text: str) -> list[int]:
        return [t for ch in text for t in self.codec.encode(ch, bos=False)]

    async def __call__(self, prompt: Sequence[int], **sampling) -> Generation:
        self.calls.append((list(prompt), sampling))
        reply = self.replies[len(self.calls) - 1]
        async with self._called:
            self._called.notify_all()
        if self.hold is not None:
            await self.hold.wait()
        if isinstance(reply, Exception):
            raise reply
        ids = [*self.spelt(reply), self.codec.eos_id]
        finish = FinishReason.STOP
        for i, t in enumerate(ids):
            if t in (sampling["stop_token_ids"] or ()):
                ids = ids[: i + 1]
                break
        limit = sampling["max_new_tokens"]
        if limit is not None and len(ids) > limit:
            ids, finish = ids[:limit], FinishReason.LENGTH
        g = Generation(
            prompt_ids=list(prompt),
            token_ids=ids,
            logprobs=[-(i + 1) / 64 for i in range(len(ids))],
            chunks=[Chunk(len(ids), VERSION)],
            finish_reason=finish,
        )
        self.generations.append(g)
        return g


def client(base_url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)


async def test_a_chat_call_sends_the_rendered_prompt_and_returns_the_engines_tokens(gateway, codec):
    policy = ScriptedPolicy(codec, ["The answer is 5."])
    messages = [{"role": "user", "content": "What is 2+3?"}]
    out = await client(gateway.open_session("s1", policy)).chat.completions.create(
        model="tiny", messages=messages, max_tokens=40, temperature=0.5, top_p=0.9, seed=7,
        logprobs=True,
    )  # fmt: skip
    [(prompt, sampling)] = policy.calls
    assert prompt == codec.encode_chat(messages)
    assert sampling == dict(
        max_new_tokens=40, temperature=0.5, top_p=0.9, seed=7, stop_token_ids=None, session="s1"
    )
    [g] = policy.generations
    choice = out.choices[0]
    assert (choice.message.content, choice.finish_reason) == ("The answer is 5.", "stop")
    assert [t.logprob for t in choice.logprobs.content] == g.logprobs
    assert (out.model, out.object) == ("tiny", "chat.completion")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), len(g.token_ids))
    assert gateway.session("s1").generations == [g]
    [t] = gateway.close_session("s1")
    assert (t.prompt_ids, t.response_ids, t.logprobs) == (prompt, g.token_ids, g.logprobs)
    assert t.loss_mask == [1] * len(g.token_ids) and t.versions == [VERSION] * len(g.token_ids)
    assert g.token_ids[:-1] != codec.encode("The answer is 5.", bos=False)  # spelt, not cut


async def test_a_streamed_chat_call_sends_the_reply_in_chunks_then_done(gateway, codec):
    policy = ScriptedPolicy(codec, ["Hello there"])
    stream = await client(gateway.open_session("s1", policy)).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]  # the client stops at data: [DONE]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert (text, finish) == ("Hello", ["length"])
    assert chunks[-1].usage.completion_tokens == 5 and policy.calls[0][1]["max_new_tokens"] == 5
    assert len({c.id for c in chunks}) == 1


async def test_a_three_turn_chat_resent_as_text_is_one_token_exact_trajectory(gateway, codec):
    replies = ["The answer is 5.", "Then add 4: 9.", "Done."]
    users = ["What is 2+3?", "And plus 4?", "Thanks!"]
    policy = ScriptedPolicy(codec, replies)
    api = client(gateway.open_session("s1", policy))
    history: list[dict] = [{"role": "system", "content": "You are a helpful assistant."}]
    for user in users:
        history.append({"role": "user", "content": user})
        out = await api.chat.completions.create(model="tiny", messages=history)
        history.append({"role": "assistant", "content": out.choices[0].message.content})
    assert [m["content"] for m in history[2::2]] == replies

    [t] = gateway.close_session("s1")
    g1, g2, g3 = policy.generations
    assert t.prompt_ids == codec.encode_chat(history[:2])
    # each turn was generated from the trajectory so far, nothing re-tokenized
    for (prompt, _), g in zip(policy.calls, policy.generations, strict=True):
        assert prompt == t.token_ids[: len(prompt)] and g.prompt_ids == prompt
    n1 = len(policy.calls[1][0]) - len(t.prompt_ids) - len(g1.token_ids)
    n2 = len(policy.calls[2][0]) - len(policy.calls[1][0]) - len(g2.token_ids)
    assert t.loss_mask == [1] * len(g1.token_ids) + [0] * n1 + [1] * len(g2.token_ids) + [
        0
    ] * n2 + [1] * len(g3.token_ids)
    trained = [tok for tok, m in zip(t.response_ids, t.loss_mask, strict=True) if m]
    assert trained == [*g1.token_ids, *g2.token_ids, *g3.token_ids]
    assert [lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m] == [
        *g1.logprobs, *g2.logprobs, *g3.logprobs
    ]  # fmt: skip
    assert {v for v, m in zip(t.versions, t.loss_mask, strict=True) if not m} == {-1}
    # the masked tokens are the template's text between the model's turns
    masked = t.response_ids[len(g1.token_ids) : len(g1.token_ids) + n1]
    turn2 = "\n<|im_start|>user\nAnd plus 4?<|im_end|>\n<|im_start|>assistant\n"
    assert codec.decode(masked, special=True) == turn2
    # the same text as the template's, in other ids: re-tokenizing would have lost them
    whole = codec.render_chat(history, add_generation_prompt=False)
    assert codec.decode(t.token_ids, special=True) + "\n" == whole
    assert t.token_ids != codec.encode_chat(history, add_generation_prompt=False)[:-1]


async def test_a_stop_token_left_out_of_the_reply_stays_in_the_trajectory(gateway, codec):
    policy = ScriptedPolicy(codec, ["7\nmore", "ok"])
    api = client(gateway.open_session("s1", policy))
    history = [{"role": "user", "content": "Say 7."}]
    out = await api.chat.completions.create(model="tiny", messages=history, stop="\n")
    assert out.choices[0].message.content == "7" and policy.calls[0][1]["stop_token_ids"] == (
        codec.encode("\n", bos=False)[0],
    )
    history += [{"role": "assistant", "content": "7"}, {"role": "user", "content": "Again."}]
    await api.chat.completions.create(model="tiny", messages=history)
    [t] = gateway.close_session("s1")  # extended: the recorded "7\n" stands in for "7"
    g1 = policy.generations[0]
    assert t.response_ids[: len(g1.token_ids)] == policy.spelt("7\n")
    assert codec.decode(t.token_ids, special=True).count("7\n<|im_end|>") == 1


async def test_a_reply_the_template_rewrites_is_held_as_generated():
    # Llama 3's template trims a turn's content: the model's own spaces stay in the tokens
    llama = TextCodec(byte_level_bpe(default_corpus(), 512, style="llama3"))
    policy = ScriptedPolicy(llama, [" Five. ", "Nine."])
    async with Gateway(llama) as gateway:
        api = client(gateway.open_session("s1", policy))
        history = [{"role": "user", "content": "2+3?"}]
        out = await api.chat.completions.create(model="tiny", messages=history)
        history += [out.choices[0].message, {"role": "user", "content": "+4?"}]
        await api.chat.completions.create(model="tiny", messages=history)
        [t] = gateway.close_session("s1")
    g1, g2 = (g.token_ids for g in policy.generations)
    masked = t.response_ids[len(g1) : len(t.response_ids) - len(g2)]
    assert t.response_ids == [*g1, *masked, *g2] and sum(t.loss_mask) == len(g1) + len(g2)
    assert llama.decode(masked, special=True) == (
        "<|start_header_id|>user<|end_header_id|>\n\n+4?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )  # the closing <|eot_id|> is the model's own


async def test_an_edited_history_starts_a_new_segment(gateway, codec):
    policy = ScriptedPolicy(codec, ["The answer is 5.", "Yes."])
    api = client(gateway.open_session("s1", policy))
    first = [{"role": "user", "content": "What is 2+3?"}]
    await api.chat.completions.create(model="tiny", messages=first)
    edited = [
        *first,
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "Sure?"},
    ]
    await api.chat.completions.create(model="tiny", messages=edited)
    a, b = gateway.close_session("s1")
    assert a.response_ids == policy.generations[0].token_ids  # untouched
    assert b.prompt_ids == codec.encode_chat(edited) and b.loss_mask == [1] * len(b.response_ids)


async def test_two_turns_at_once_on_one_history_make_two_segments(gateway, codec):
    policy = ScriptedPolicy(codec, ["5.", "9.", "6."])
    api = client(gateway.open_session("s1", policy))
    history = [{"role": "user", "content": "2+3?"}]
    await api.chat.completions.create(model="tiny", messages=history)
    history.append({"role": "assistant", "content": "5."})
    branches = [[*history, {"role": "user", "content": q}] for q in ("+4?", "+1?")]
    policy.hold = asyncio.Event()
    calls = [
        asyncio.create_task(api.chat.completions.create(model="tiny", messages=b)) for b in branches
    ]
    await policy.called(3)  # both being generated: the first to come holds the segment
    policy.hold.set()
    await asyncio.gather(*calls)
    first, second = gateway.close_session("s1")
    g1 = policy.generations[0].token_ids
    assert first.response_ids[: len(g1)] == g1
    later = [prompt for prompt, _ in policy.calls[1:]]
    assert second.prompt_ids in later  # one branch as sent, re-tokenized
    assert second.prompt_ids in [codec.encode_chat(b) for b in branches]
    [extended] = [p for p in later if p != second.prompt_ids]  # the other went on the first
    assert extended == first.token_ids[: len(extended)] and len(first.token_ids) > len(extended)


async def test_completions_extend_a_text_prompt_and_stream(gateway, codec):
    policy = ScriptedPolicy(codec, [" 5.", " 9.", " 1."])
    api = client(gateway.open_session("s1", policy))
    first = "2+3 ="
    out = await api.completions.create(model="tiny", prompt=first, logprobs=0)
    text = out.choices[0].text
    assert out.choices[0].logprobs.token_logprobs == policy.generations[0].logprobs
    assert "".join(out.choices[0].logprobs.tokens) == " 5.<|im_end|>"
    second = f"{first}{text} 5+4 ="
    stream = await api.completions.create(model="tiny", prompt=second, stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == " 9."
    held = gateway.session("s1").trajectories()[0].token_ids
    await api.completions.create(model="tiny", prompt=[*held, *codec.encode(" 0+1 =", bos=False)])
    [t] = gateway.close_session("s1")
    assert t.prompt_ids == codec.encode(first)
    g1, g2, g3 = policy.generations
    extra = codec.encode(" 5+4 =", bos=False)
    assert t.response_ids[: len(g1.token_ids) + len(extra)] == [*g1.token_ids, *extra]
    assert sum(t.loss_mask) == sum(len(g.token_ids) for g in (g1, g2, g3))


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        ({"messages": openai.omit}, "messages"),
        ({"messages": []}, "messages"),
        ({"temperature": 3.0}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 2}, "n"),
        ({"stop": ["The answer"]}, "stop"),  # not one token
        ({"messages": [{"role": "tool", "content": "4"}]}, "messages"),  # the template refuses
    ],
)
async def test_a_bad_chat_request_is_a_400_in_openais_error_shape(gateway, codec, request_, param):
    policy = ScriptedPolicy(codec, [])
    api = client(gateway.open_session("s1", policy))
    body = {"messages": [{"role": "user", "content": "hi"}], **request_}
    with pytest.raises(openai.BadRequestError) as err:
        await api.chat.completions.create(model="tiny", **body)
    assert err.value.status_code == 400 and err.value.param == param
    assert set(err.value.body) == {"message", "type", "param", "code"}
    assert err.value.type == "invalid_request_error" and policy.calls == []


async def test_an_unknown_session_is_a_404_and_models_are_listed(gateway, codec):
    base = gateway.open_session("s1", ScriptedPolicy(codec, []))
    assert [m.id async for m in client(base).models.list()] == [DEFAULT_MODEL]
    with pytest.raises(openai.NotFoundError) as err:
        await client(base.replace("/s1/", "/s2/")).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}]
        )
    assert err.value.code == "session_not_found" and "s2" in err.value.message


async def test_a_failed_generate_is_a_500_and_leaves_the_session_as_it_was(gateway, codec):
    policy = ScriptedPolicy(codec, ["5.", RuntimeError("replica gone"), "9."])
    api = client(gateway.open_session("s1", policy))
    history: list = [{"role": "user", "content": "2+3?"}]
    out = await api.chat.completions.create(model="tiny", messages=history)
    # the reply's message object re-sent as it is, as agent code often does
    history += [out.choices[0].message, {"role": "user", "content": "+4?"}]
    with pytest.raises(openai.InternalServerError, match="replica gone"):
        await api.chat.completions.create(model="tiny", messages=history)
    await api.chat.completions.create(model="tiny", messages=history)  # the retry extends
    [t] = gateway.close_session("s1")
    assert policy.calls[1][0] == policy.calls[2][0]
    assert sum(t.loss_mask) == sum(len(g.token_ids) for g in policy.generations)
