"""Codec: envelopes round trip, bad frames are named, HMAC catches foreign frames."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivot.bus import Codec, Message, RemoteFailure
from pivot.bus.codec import TRAILER_SIZE, Seal, topic_prefix
from pivot.bus.errors import BadSignature, FrameError


class Item(Message):
    name: str
    count: int


class Batch(Message):
    items: list[Item]
    note: str | None = None
    weights: dict[str, float] = {}


class Base(msgspec.Struct, tag=True):
    pass


class Left(Base):
    x: int


class Right(Base):
    y: str


class Deeper(Left):
    z: float


def test_request_reply_error_and_publish_round_trip() -> None:
    codec = Codec([Item, Batch])
    batch = Batch(items=[Item("a", 1), Item("b", 2)], note="n", weights={"w": 0.5})

    request = codec.decode_request(codec.encode_request("alice", 7, batch))
    assert (request.sender, request.cid, request.body) == ("alice", 7, batch)

    reply = codec.decode_reply(codec.encode_reply("bob", 7, Item("c", 3)))
    assert type(reply) is codec.ReplyEnvelope
    assert (reply.sender, reply.cid, reply.body) == ("bob", 7, Item("c", 3))
    assert codec.decode_reply(codec.encode_reply("bob", 8, None)).body is None

    error = codec.decode_reply(codec.encode_error("bob", 9, "handler_error", "KeyError", "'k'"))
    assert type(error) is codec.ErrorEnvelope
    assert error.body == RemoteFailure(code="handler_error", error_type="KeyError", text="'k'")

    frame = codec.encode_publish("carol", topic_prefix("metrics"), 3, [Item("d", 4), batch])
    assert frame.startswith(b"metrics\0")
    topic, publication = codec.decode_publish(frame)
    assert (topic, publication.sender, publication.seq) == ("metrics", "carol", 3)
    assert publication.body == [Item("d", 4), batch]


@settings(max_examples=50, deadline=None)
@given(
    name=st.text(max_size=50),
    count=st.integers(min_value=-(2**63), max_value=2**63 - 1),
    sender=st.text(min_size=1, max_size=20),
    cid=st.integers(min_value=0, max_value=2**63 - 1),
    to=st.text(max_size=300),
    incarnation=st.integers(min_value=0, max_value=2**64 - 1),
)
def test_any_item_round_trips(
    name: str, count: int, sender: str, cid: int, to: str, incarnation: int
) -> None:
    codec = Codec([Item], secret=b"k")
    seal = Seal(to, incarnation, cid)
    payload, unsealed = codec.unseal(codec.encode_request(sender, cid, Item(name, count), seal))
    envelope = codec.request_of(payload)
    assert (envelope.sender, envelope.cid, envelope.body) == (sender, cid, Item(name, count))
    assert unsealed == seal


def test_a_codec_takes_the_classes_it_is_given_and_no_others() -> None:
    codec = Codec([Left, Deeper])
    assert codec.decode_request(codec.encode_request("s", 1, Deeper(x=1, z=2.0))).body == Deeper(
        x=1, z=2.0
    )
    assert not codec.knows(Right(y="r"))  # a sibling defined alongside is not registered


def test_codec_rejects_types_that_cannot_join_the_union() -> None:
    class Untagged(msgspec.Struct):
        a: int

    class Clash(msgspec.Struct, tag="Item"):
        b: int

    with pytest.raises(TypeError, match="Untagged has no tag"):
        Codec([Untagged])
    with pytest.raises(TypeError, match="share the tag 'Item'"):
        Codec([Item, Clash])
    with pytest.raises(TypeError, match="msgspec.Struct"):
        Codec([dict])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="empty shared secret"):
        Codec([Item], secret=b"")


def test_garbage_is_a_frame_error() -> None:
    codec = Codec([Item])
    nested = b"\x91" * 100_000 + b"\xc0"  # deeper than the decoder's recursion limit
    for garbage in (b"", b"\xc1", b"\x93\x00\x01", msgspec.msgpack.encode({"a": 1}), nested):
        with pytest.raises(FrameError):
            codec.decode_request(garbage)


def test_unknown_type_error_still_names_sender_and_cid() -> None:
    sender_codec = Codec([Item, Batch])
    receiver_codec = Codec([Item])
    frame = sender_codec.encode_request("alice", 41, Batch(items=[]))
    with pytest.raises(FrameError) as caught:
        receiver_codec.decode_request(frame)
    assert (caught.value.sender, caught.value.cid) == ("alice", 41)
    assert "Batch" in caught.value.text


def test_a_request_frame_is_not_a_reply() -> None:
    codec = Codec([Item])
    with pytest.raises(FrameError):
        codec.decode_reply(codec.encode_request("a", 1, Item("x", 1)))


def test_hmac_accepts_own_frames_and_rejects_others() -> None:
    ours = Codec([Item], secret="secret one")
    theirs = Codec([Item], secret="secret two")
    unsigned = Codec([Item])
    seal = Seal("b", 5, 1)
    frame = ours.encode_request("a", 1, Item("x", 1), seal)
    assert len(frame) == len(unsigned.encode_request("a", 1, Item("x", 1))) + 1 + TRAILER_SIZE
    assert ours.decode_request(frame).body == Item("x", 1)
    assert ours.unseal(frame)[1] == seal
    with pytest.raises(BadSignature):
        theirs.decode_request(frame)
    with pytest.raises(BadSignature):
        ours.decode_request(unsigned.encode_request("a", 1, Item("x", 1)))
    # the envelope, the destination and the counter are all covered by the HMAC
    for where in (5, len(frame) - TRAILER_SIZE - 1, len(frame) - 33):
        tampered = bytearray(frame)
        tampered[where] ^= 0x01
        with pytest.raises(BadSignature):
            ours.decode_request(bytes(tampered))
    with pytest.raises(BadSignature):
        ours.decode_request(b"short")
    with pytest.raises(ValueError, match="pass its Seal"):
        ours.encode_request("a", 1, Item("x", 1))
    published = ours.encode_publish("a", topic_prefix("t"), 4, [Item("y", 2)], incarnation=9)
    assert ours.decode_publish(published)[1].body == [Item("y", 2)]
    assert ours.unseal(published)[1] == Seal("", 9, 4)  # sealed with its sequence number
    with pytest.raises(BadSignature):
        theirs.decode_publish(published)


def test_without_a_secret_a_frame_is_the_envelope_alone() -> None:
    codec = Codec([Item])
    frame = codec.encode_request("a", 1, Item("x", 1), Seal("b", 5, 1))  # the seal is ignored
    assert frame == msgspec.msgpack.encode((0, "a", 1, Item("x", 1)))
    assert codec.unseal(frame) == (frame, None)


def test_topics_are_validated() -> None:
    assert topic_prefix("metrics/replica") == b"metrics/replica\0"
    for bad in ("", "a\0b", "x" * 201):
        with pytest.raises(ValueError):
            topic_prefix(bad)
