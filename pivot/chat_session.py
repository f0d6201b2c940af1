"""The token bookkeeping of one OpenAI-gateway session: which exact token ids each request is
sent as, and the trajectories they add up to.

An OpenAI client re-sends the whole history as text every turn. Re-tokenizing it would not
give back the ids the engine read and wrote (a model may write a word in other pieces than the
tokenizer would cut it; a chat template may trim a turn, or strip its reasoning), so a session
never re-tokenizes a turn it generated. It keeps its trajectories as *segments*; a request
**extends** a segment when its history is that segment's history followed by the reply the
gateway returned for it, exactly:

- chat: the request's messages start with the segment's messages, then an assistant message
  whose content is the reply returned. The next prompt is the segment's tokens (the model's
  turn as it was generated stands in for the assistant message), then the chat template's
  text after that assistant message's content: the turn's closing (e.g. ``<|im_end|>\n``,
  less the eos or stop token the model wrote itself) and the new messages with the generation
  prompt, encoded on their own and appended masked. Where the content ends is found by
  rendering a placeholder in its place, so what the template does to the content does not
  matter; the template must only append (its text of the history with the reply and the new
  messages starts with its text of the history).
- text (``/v1/completions``): the new prompt starts with the previous prompt and the reply
  (or the generated text, stop token included); the rest is encoded and appended masked. A
  prompt of token ids extends a segment whose tokens are its prefix.

**The rule for anything else** (an edited or dropped turn, a reply changed by the client, a
template that rewrites the history it already wrote, a repeated request, a second request on
a segment whose turn is still being generated): the request starts a **new segment** of the
same rollout, its prompt the chat template's encoding of the messages as sent. No earlier
segment changes, so each is exactly what the engine saw; the rollout gets them all, in the
order they began (usually there is one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pivot.engines.protocol import FinishReason
from pivot.engines.sim_engine import Placeholders
from pivot.trajectory import Generation, Trajectory, TrajectoryError

if TYPE_CHECKING:
    from pivot.engines.tokenizer import TextCodec

Messages = list[dict[str, Any]]

# rendered in the place of a reply to find where the template puts its content
PLACEHOLDER = "[[pivot: the assistant's reply]]"


@dataclass(eq=False)
class Segment:
    """One trajectory of a session and what its tokens hold: for a chat segment the messages
    its last prompt was rendered from (``messages``, their rendering ``prompt_text``), for a
    text segment its last prompt (``prompt_text``; None when it came as ids); then the ids the
    last turn generated, the reply returned for them, and the text of the final stop token
    the reply left out ("" when none)."""

    chat: bool
    trajectory: Trajectory
    messages: Messages
    prompt_text: str | None
    generated: list[int]
    reply: str
    stop_text: str = ""
    busy: bool = False  # a turn extending it is being generated


@dataclass(eq=False)
class Turn:
    """A request planned against a session: the ids to generate from and where they go.
    ``segment`` None: the turn starts a new segment."""

    prompt_ids: list[int]
    chat: bool
    messages: Messages = field(default_factory=list)
    prompt_text: str | None = None
    segment: Segment | None = None
    added: list[int] = field(default_factory=list)  # masked ids appended to the segment


class ChatSession:
    """One session's segments and every generation it got (``generations``, in order)."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.segments: list[Segment] = []
        self.generations: list[Generation] = []

    def trajectories(self) -> list[Trajectory]:
        return [s.trajectory for s in self.segments]

    # planning: what a request is sent as

    def chat_turn(self, messages: Messages) -> Turn:
        """The turn for chat ``messages`` (ValueError, or the template's own error, when the
        chat template cannot render them)."""
        full = self.codec.render_chat(messages)
        for seg in self._idle(chat=True):
            added = self._chat_extension(seg, messages)
            if added is not None:
                return self._reserve(seg, added, messages=messages, prompt_text=full)
        return Turn(self.codec.encode_chat(messages), True, messages=messages, prompt_text=full)

    def text_turn(self, prompt: str | Sequence[int]) -> Turn:
        """The turn for a completion's prompt (text, or token ids)."""
        if isinstance(prompt, str):
            for seg in self._idle(chat=False):
                added = self._text_extension(seg, prompt)
                if added is not None:
                    return self._reserve(seg, added, prompt_text=prompt)
            return Turn(self.codec.encode(prompt), False, prompt_text=prompt)
        ids = [int(t) for t in prompt]
        for seg in self._idle(chat=False):
            held = seg.trajectory.token_ids
            if ids[: len(held)] == held:
                return self._reserve(seg, ids[len(held) :])
        return Turn(ids, False)

    def _idle(self, *, chat: bool) -> list[Segment]:
        # newest first: a client that branched continues its latest branch
        return [s for s in reversed(self.segments) if s.chat == chat and not s.busy]

    def _reserve(self, seg: Segment, added: list[int], **what: Any) -> Turn:
        seg.busy = True
        return Turn([*seg.trajectory.token_ids, *added], seg.chat, segment=seg, added=added, **what)

    def _chat_extension(self, seg: Segment, messages: Messages) -> list[int] | None:
        n = len(seg.messages)
        if len(messages) <= n or messages[:n] != seg.messages:
            return None
        if messages[n] != {"role": "assistant", "content": seg.reply}:
            return None
        probe = [*seg.messages, {"role": "assistant", "content": PLACEHOLDER}]
        with_reply = self.codec.render_chat(probe, add_generation_prompt=False)
        full = self.codec.render_chat([*probe, *messages[n + 1 :]])
        held = seg.prompt_text or ""
        if not (with_reply.startswith(held) and full.startswith(with_reply)):
            return None  # the template rewrites the history rather than appending to it
        turn = with_reply[len(held) :]
        if turn.count(PLACEHOLDER) != 1:
            return None
        closing = turn[turn.index(PLACEHOLDER) + len(PLACEHOLDER) :]
        if seg.stop_text and closing.startswith(seg.stop_text):
            closing = closing[len(seg.stop_text) :]  # the model wrote the template's eos
        return self.codec.encode(closing + full[len(with_reply) :], bos=False)

    def _text_extension(self, seg: Segment, prompt: str) -> list[int] | None:
        if seg.prompt_text is None:
            return None
        heads = (self.codec.decode(seg.generated), seg.reply)
        for head in sorted(heads, key=len, reverse=True):
            held = seg.prompt_text + head
            if prompt.startswith(held):
                return self.codec.encode(prompt[len(held) :], bos=False)
        return None

    # recording: what came back

    def release(self, turn: Turn) -> None:
        """Forget ``turn`` (its generation failed or was abandoned)."""
        if turn.segment is not None:
            turn.segment.busy = False

    def record(self, turn: Turn, generation: Generation, stop_token_ids: Sequence[int] = ()) -> str:
        """Add ``generation`` (the engine's answer to ``turn.prompt_ids``) to the session and
        return the reply text: its decoded tokens, less a final stop token (OpenAI's replies
        leave the stop sequence out; the trajectory keeps it)."""
        try:
            ids = generation.token_ids
            if isinstance(ids, Placeholders):
                raise TrajectoryError("a simulated engine's placeholder ids have no text")
            if list(generation.prompt_ids) != turn.prompt_ids:
                raise TrajectoryError(
                    f"the engine answered a prompt of {len(generation.prompt_ids)} tokens, "
                    f"not the {len(turn.prompt_ids)} it was sent"
                )
            ids = list(ids)
            stops = {*stop_token_ids, self.codec.eos_id}
            stopped = generation.finish_reason is FinishReason.STOP and ids and ids[-1] in stops
            reply = self.codec.decode(ids[:-1] if stopped else ids)
            seg = turn.segment
            if seg is None:
                seg = Segment(turn.chat, Trajectory(prompt_ids=turn.prompt_ids), [], None, [], "")
                seg.trajectory.add_generation(generation)
                self.segments.append(seg)
            else:
                seg.trajectory.add_tokens(turn.added).add_generation(generation)
            seg.messages, seg.prompt_text = turn.messages, turn.prompt_text
            seg.generated, seg.reply = ids, reply
            seg.stop_text = self.codec.decode(ids[-1:], special=True) if stopped else ""
            self.generations.append(generation)
            return reply
        finally:
            self.release(turn)
