"""GRPO math: advantages, the clipped token-level loss (against a case worked out by hand),
batch building, data-parallel sharding and the settings."""

from __future__ import annotations

import math

import pytest
import torch

from pivot.config import ConfigError, decode_toml
from pivot.grpo import (
    BatchError,
    GRPOBatch,
    RolloutSample,
    TrainingSettings,
    build_batch,
    group_advantages,
    policy_loss,
    token_logprobs,
    warmup_factor,
)
from pivot.trajectory import NO_VERSION


def sample(
    prompt, response, *, reward=0.0, group=0, logprobs=None, loss_mask=(), versions=()
) -> RolloutSample:
    return RolloutSample(
        prompt_ids=list(prompt),
        response_ids=list(response),
        logprobs=list(logprobs) if logprobs is not None else [-1.0] * len(response),
        reward=reward,
        group=group,
        loss_mask=list(loss_mask),
        versions=list(versions),
    )


# ---- advantages -------------------------------------------------------------------------------


def test_advantages_are_normalised_within_each_group() -> None:
    # group 7: rewards 1, 0, 0, 0 -> mean 0.25; sample std sqrt((0.75^2 + 3 * 0.25^2) / 3)
    #   = sqrt(0.75 / 3) = 0.5 -> advantages 0.75 / 0.5 = 1.5 and -0.25 / 0.5 = -0.5
    # group 3: rewards 2, 4 -> mean 3, sample std sqrt(2) -> -1/sqrt(2), +1/sqrt(2)
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.0, 4.0, 0.0])
    groups = torch.tensor([7, 7, 3, 7, 3, 7])
    adv = group_advantages(rewards, groups, eps=0.0)
    s = 1 / math.sqrt(2)
    assert adv.tolist() == pytest.approx([1.5, -0.5, -s, -0.5, s, -0.5], abs=1e-6)


def test_eps_keeps_the_division_finite_and_shrinks_advantages_slightly() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 0]), eps=0.5)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])  # / (0.5 + 0.5)


def test_zero_std_and_single_sample_groups_get_zero_advantage() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.3, 5.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 2, 2])
    adv = group_advantages(rewards, groups)
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]  # all equal; a group of one
    assert adv[4] > 0 > adv[5]


def test_advantages_reject_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="one shape"):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))


# ---- the loss ---------------------------------------------------------------------------------


def hand_case():
    """Two sequences, three response tokens each, plus one masked column.

    Row 0, A = +1.5, ratios 1.0, 1.5, 0.5:
        r=1.0: -A r = -1.5                 (inside the clip range)
        r=1.5: max(-2.25, -1.5 * 1.28 = -1.92) = -1.92   clipped high
        r=0.5: max(-0.75, -1.5 * 0.8 = -1.2) = -0.75     A > 0: no clip below
    Row 1, A = -0.5, ratios 0.5, 1.2, 20:
        r=0.5: max(0.25, 0.5 * 0.8 = 0.4) = 0.4          clipped low
        r=1.2: max(0.6, 0.6) = 0.6                        inside
        r=20:  max(10, 0.5 * 1.28 = 0.64) = 10, dual clip c=3: min(10, 0.5 * 3) = 1.5
    Masked column: ratio 100, must count for nothing.
    Sum -1.5 - 1.92 - 0.75 + 0.4 + 0.6 + 1.5 = -1.67 over 6 tokens: loss -0.278333...
    Clipped: 3 of 6 tokens. Mean ratio (1 + 1.5 + 0.5 + 0.5 + 1.2 + 20) / 6 = 24.7 / 6.
    """
    ratios = torch.tensor([[1.0, 1.5, 0.5, 100.0], [0.5, 1.2, 20.0, 100.0]])
    old = torch.full((2, 4), -2.0)
    new = (old + ratios.log()).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([1.5, -0.5])
    return new, old, adv, mask


def test_clipped_loss_matches_the_hand_computed_case() -> None:
    new, old, adv, mask = hand_case()
    loss, sums = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert loss.item() == pytest.approx(-1.67 / 6, abs=1e-6)
    assert sums.tokens == 6
    assert sums.mean("loss") == pytest.approx(-1.67 / 6, abs=1e-6)
    assert sums.mean("clipped") == pytest.approx(0.5)
    assert sums.mean("ratio") == pytest.approx(24.7 / 6, rel=1e-6)


def test_gradient_flows_only_through_unclipped_tokens() -> None:
    # d loss / d logprob = -A r / 6 where the unclipped term is chosen, 0 where a clip is
    new, old, adv, mask = hand_case()
    loss, _ = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    loss.backward()
    expected = [[-1.5 / 6, 0.0, -0.75 / 6, 0.0], [0.0, 0.6 / 6, 0.0, 0.0]]
    assert new.grad.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]


def test_without_dual_clip_a_huge_ratio_counts_in_full() -> None:
    new, old, adv, mask = hand_case()
    loss, sums = policy_loss(new, old, adv, mask, dual_clip=None)
    assert loss.item() == pytest.approx((-1.67 - 1.5 + 10.0) / 6, abs=1e-5)
    assert sums.mean("clipped") == pytest.approx(2 / 6)


def test_denominator_replaces_the_token_count() -> None:
    new, old, adv, mask = hand_case()
    loss, _ = policy_loss(new, old, adv, mask, dual_clip=3.0, denominator=12.0)
    assert loss.item() == pytest.approx(-1.67 / 12, abs=1e-6)


def test_kl_term_is_off_by_default_and_k3_when_on() -> None:
    new, old, adv, mask = hand_case()
    ref = new.detach() + 0.1  # d = 0.1 on every token: k3 = e^0.1 - 0.1 - 1
    base, _ = policy_loss(new, old, adv, mask, dual_clip=3.0, ref_logprobs=ref)
    with_kl, sums = policy_loss(new, old, adv, mask, dual_clip=3.0, ref_logprobs=ref, kl_coef=0.5)
    k3 = math.exp(0.1) - 0.1 - 1
    assert base.item() == pytest.approx(-1.67 / 6, abs=1e-6)
    assert with_kl.item() == pytest.approx(-1.67 / 6 + 0.5 * k3, abs=1e-6)
    assert sums.mean("kl") == pytest.approx(k3, rel=1e-4)


def test_token_logprobs_score_the_next_token() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    got = token_logprobs(logits, ids, temperature=2.0)
    assert got.shape == (2, 4)
    for b in range(2):
        for t in range(4):
            want = torch.log_softmax(logits[b, t] / 2.0, dim=-1)[ids[b, t + 1]]
            assert got[b, t].item() == pytest.approx(want.item(), abs=1e-6)


def test_warmup_ramps_linearly_then_holds() -> None:
    assert [warmup_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0


# ---- batches ----------------------------------------------------------------------------------


def test_batch_pads_and_masks_response_tokens() -> None:
    batch = build_batch(
        [
            sample([1, 5, 6], [7, 8], reward=1.0, group=0, logprobs=[-0.1, -0.2]),
            sample([1, 5], [9, 10, 11], reward=0.0, group=0, logprobs=[-0.3, -0.4, -0.5]),
            sample([1], [12], reward=0.5, group=1, logprobs=[-0.6]),
        ],
        pad_id=0,
        advantage_eps=1e-6,
    )
    assert batch.input_ids.tolist() == [[1, 5, 6, 7, 8], [1, 5, 9, 10, 11], [1, 12, 0, 0, 0]]
    # column t is about token t + 1
    assert batch.response_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1], [1, 0, 0, 0]]
    assert batch.old_logprobs.tolist() == [
        pytest.approx([0, 0, -0.1, -0.2]),
        pytest.approx([0, -0.3, -0.4, -0.5]),
        pytest.approx([-0.6, 0, 0, 0]),
    ]
    assert batch.tokens == 6
    # group 0 holds rewards 1 and 0: +-1/sqrt(2) (sample std); group 1 is alone: 0
    s = 1 / math.sqrt(2)
    assert batch.advantages.tolist() == pytest.approx([s, -s, 0.0], abs=1e-5)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (sample([1], [2, 3], logprobs=[-1.0]), "1 logprobs for 2 response tokens"),
        (sample([1], []), "empty response_ids"),
        (sample([], [2]), "empty prompt_ids"),
        (sample([1], [2], reward=float("nan")), "reward is nan"),
        (sample([1], [2], logprobs=[0.5]), "logprobs must be finite and <= 0"),
        (sample([1], [99]), "out of the vocabulary"),
        (sample([1] * 10, [2]), "more than the model's 8 positions"),
        (sample([1], [2, 3], loss_mask=[1]), "loss_mask has 1 entries for 2 response tokens"),
        (sample([1], [2], versions=[0, 0]), "versions has 2 entries for 1 response tokens"),
        (sample([1], [2], loss_mask=[2]), "loss_mask holds values other than 0 and 1"),
        (sample([1], [2, 3], versions=[0, NO_VERSION]), "a trained token .* has no policy"),
    ],
)
def test_bad_samples_are_refused_by_index(bad: RolloutSample, message: str) -> None:
    with pytest.raises(BatchError, match=rf"sample 1 \(group 0\): .*{message}"):
        build_batch([sample([1], [2]), bad], pad_id=0, vocab_size=50, max_len=8)


def test_an_empty_batch_is_refused() -> None:
    with pytest.raises(BatchError, match="at least one"):
        build_batch([], pad_id=0)
    with pytest.raises(BatchError, match="max_staleness must be >= 0, got -1"):
        build_batch([sample([1], [2])], pad_id=0, max_staleness=-1)


def test_a_loss_mask_leaves_tool_tokens_out_of_the_loss_and_their_logprobs_ignored() -> None:
    # a two-turn response: the policy's 7, a tool's 8 9 (logprobs not the policy's), the
    # policy's 10
    turns = sample(
        [1, 5],
        [7, 8, 9, 10],
        logprobs=[-0.1, float("nan"), 0.0, -0.4],
        loss_mask=[1, 0, 0, 1],
        versions=[3, NO_VERSION, NO_VERSION, 3],
    )
    batch = build_batch([turns, sample([1], [2, 3])], pad_id=0, version=3, max_staleness=0)
    assert batch.response_mask.tolist() == [[0, 1, 0, 0, 1], [1, 1, 0, 0, 0]]
    assert batch.old_logprobs[0].tolist() == pytest.approx([0, -0.1, 0, 0, -0.4])
    assert (batch.tokens, batch.masked_tokens, batch.stale_tokens) == (4, 2, 0)


def test_tokens_older_than_the_staleness_bound_are_masked_and_counted() -> None:
    samples = [
        sample([1], [2, 3, 4, 5], versions=[3, 4, 5, 5]),
        # a tool token (NO_VERSION) is masked, not stale
        sample([1], [6, 7, 8], loss_mask=[1, 0, 1], versions=[2, NO_VERSION, 5], group=1),
    ]
    batch = build_batch(samples, pad_id=0, version=5, max_staleness=1)  # oldest allowed: 4
    assert batch.response_mask.tolist() == [[0, 1, 1, 1], [0, 0, 1, 0]]
    assert (batch.tokens, batch.masked_tokens, batch.stale_tokens) == (4, 1, 2)
    assert batch.stale.tolist() == [1, 1] and batch.masked.tolist() == [0, 1]
    rank0, rank1 = batch.shard(0, 2), batch.shard(1, 2)
    assert (rank0.stale_tokens, rank1.stale_tokens, rank1.masked_tokens) == (1, 1, 1)
    # without a bound every sampled token trains, whichever policy sampled it
    unbounded = build_batch(samples, pad_id=0, version=5)
    assert (unbounded.tokens, unbounded.stale_tokens) == (6, 0)


def test_a_sample_whose_tokens_are_all_masked_trains_nothing_and_divides_by_nothing() -> None:
    batch = build_batch(
        [
            sample([1], [2, 3], loss_mask=[0, 0], reward=1.0),
            sample([1], [4], versions=[0], reward=0.0),
        ],
        pad_id=0,
        version=9,
        max_staleness=2,
    )
    assert (batch.tokens, batch.masked_tokens, batch.stale_tokens) == (0, 2, 1)
    logits = torch.randn(2, 3, 8, requires_grad=True)
    logp = token_logprobs(logits, batch.input_ids)
    loss, sums = policy_loss(logp, batch.old_logprobs, batch.advantages, batch.response_mask)
    loss.backward()
    assert loss.item() == 0.0 and sums.tokens == 0.0 and sums.mean("ratio") == 0.0
    assert logits.grad is not None and not logits.grad.any()


def test_masked_and_stale_tokens_get_no_gradient() -> None:
    torch.manual_seed(0)
    batch = build_batch(
        [
            sample([1], [2, 3, 4, 5], loss_mask=[1, 0, 1, 1], versions=[1, NO_VERSION, 0, 1]),
            sample([1], [6, 7, 8, 9], reward=1.0),
        ],
        pad_id=0,
        version=1,
        max_staleness=0,
    )
    logits = torch.randn(2, 5, 16, requires_grad=True)
    logp = token_logprobs(logits, batch.input_ids)
    loss, _ = policy_loss(
        logp,
        batch.old_logprobs,
        batch.advantages,
        batch.response_mask,
        clip_low=0.99,  # no clip: a clipped token has no gradient either
        clip_high=100.0,
        dual_clip=None,
    )
    loss.backward()
    # column t of sample 0 scores response token t: trained 0 and 3; the tool's 1, the stale 2
    per_column = logits.grad[0, :4].abs().sum(dim=-1)
    assert (per_column[[1, 2]] == 0).all() and (per_column[[0, 3]] > 0).all()


def five_rows() -> GRPOBatch:
    return build_batch(
        [
            sample([1, 2], [3] * n, reward=float(i % 2), group=i // 2)
            for i, n in enumerate([1, 4, 2, 6, 3])
        ],
        pad_id=0,
    )


def test_shards_stride_rows_and_pad_the_short_rank() -> None:
    batch = five_rows()
    rank0, rank1 = batch.shard(0, 2), batch.shard(1, 2)
    assert rank0.size == rank1.size == 3
    assert rank0.response_mask.sum(dim=1).tolist() == [1, 2, 3]  # rows 0, 2, 4
    assert rank1.response_mask.sum(dim=1).tolist() == [4, 6, 0]  # rows 1, 3, an empty row
    assert rank0.tokens + rank1.tokens == batch.tokens
    # trimmed to the longest row held: prompt 2 + response 3 (rank 0), 2 + 6 (rank 1)
    assert rank0.input_ids.shape[1] == 5 and rank1.input_ids.shape[1] == 8
    assert rank1.groups.tolist()[-1] == -1 and rank1.advantages.tolist()[-1] == 0.0


def test_micro_batches_and_shards_add_up_to_the_whole_batch_gradient() -> None:
    """Token-mean over the batch = sum over ranks and micro-batches of token sums divided by
    (tokens / world size), averaged over ranks (what data-parallel gradient averaging does)."""
    torch.manual_seed(0)
    batch = build_batch(
        [
            sample([1, 2], [(3 + i + k) % 16 for k in range(n)], reward=float(i % 3), group=i // 3)
            for i, n in enumerate([1, 4, 2, 6, 3, 5, 2])
        ],
        pad_id=0,
    )
    batch.old_logprobs = batch.old_logprobs - 0.3 * batch.response_mask  # ratios off 1
    table = torch.nn.Embedding(16, 16)  # a "model": logits are a lookup of the current token

    def loss_of(rows: GRPOBatch, denominator: float | None) -> torch.Tensor:
        logp = token_logprobs(table(rows.input_ids), rows.input_ids)
        loss, _ = policy_loss(
            logp, rows.old_logprobs, rows.advantages, rows.response_mask, denominator=denominator
        )
        return loss

    loss_of(batch, None).backward()
    whole = table.weight.grad.clone()
    table.weight.grad = None
    world = 2
    for rank in range(world):
        for micro in batch.shard(rank, world).micro_batches(2):
            (loss_of(micro, batch.tokens / world) / world).backward()  # / world: DP average
    assert torch.allclose(table.weight.grad, whole, atol=1e-6)


# ---- settings ---------------------------------------------------------------------------------


def test_settings_defaults_follow_the_paper_except_the_learning_rate() -> None:
    s = TrainingSettings()
    assert (s.clip_low, s.clip_high, s.dual_clip, s.grad_clip) == (0.2, 0.28, 10.0, 1.0)
    assert s.kl_coef == 0.0 and s.zero_stage == 2 and s.weight_decay == 0.1
    assert 1e-4 <= s.lr <= 1e-3


@pytest.mark.parametrize(
    ("text", "key"),
    [("zero_stage = 4", "zero_stage"), ("clip_low = 1.5", "clip_low"), ("lr = 0", "lr")],
)
def test_bad_settings_name_the_key(text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"key '{key}'"):
        decode_toml(text, TrainingSettings, "trainer.toml")


def test_settings_read_from_toml() -> None:
    s = decode_toml("lr = 1e-3\nzero_stage = 3\nmicro_batch_size = 4", TrainingSettings)
    assert (s.lr, s.zero_stage, s.micro_batch_size) == (1e-3, 3, 4)
