"""Simulated workloads: every config under configs/sim loads with the seed's model groups,
samplers are deterministic and order-independent, lengths respect their bounds, bad configs
get errors naming the key."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pivot.cluster import Role
from pivot.config import ConfigError
from pivot.engines.sim_engine import sim_sampling
from pivot.workload import load_workload, load_workloads

ROOT = Path(__file__).resolve().parents[2]
SIM = ROOT / "configs" / "sim"
GROUP = SIM / "qwen2.5-7b_qwen3-30b-a3b.toml"

# the seed's Table 1: (policy, TP), (GenRM, TP)
TABLE_1 = {
    ("qwen2.5-1.5b", 1, "glm-z1-9b", 1),
    ("qwen2.5-7b", 1, "qwen3-30b-a3b", 4),
    ("qwen2.5-32b", 4, "qwen3-30b-a3b", 4),
    ("qwen2.5-72b", 8, "qwen3.5-122b-a10b", 8),
}


@pytest.fixture(scope="module")
def workloads():
    return load_workloads(SIM)


def test_every_config_loads_with_the_seed_model_groups(workloads):
    found = {
        (c.policy.model, c.policy.layout.tp, c.genrm.model, c.genrm.layout.tp)
        for c in (w.config for w in workloads.values())
    }
    assert found == TABLE_1
    for w in workloads.values():
        c = w.config
        assert (c.batch.prompts_per_step, c.batch.samples_per_prompt) == (128, 16)
        assert c.response.max == 15360 and c.judgment.max == 20480
        for role in (Role.ROLLOUT, Role.REWARD):
            assert w.cost_model(role).itl_one(1, 0) > 0
            e = w.make_engine(role, seed=1)
            assert e.max_running == w.model(role).max_running


def test_every_config_states_its_estimates():
    for path in SIM.glob("*.toml"):
        text = path.read_text()
        assert "ESTIMATE" in text and "SOURCE" in text, path
        for section in ("[response]", "[judgment]", "[trainer]", "[shift]", "[hardware]"):
            assert section in text, (path, section)


def test_samples_are_deterministic_and_order_independent(workloads):
    w = workloads["qwen2.5-7b_qwen3-30b-a3b"]
    first = w.sampler(3)
    for step in range(3):
        first.step(step)
    later = first.step(3)
    fresh = w.sampler(3).step(3)
    for name in ("prompt_tokens", "response_tokens", "judgment_tokens", "genrm_prompt_tokens"):
        assert np.array_equal(getattr(later, name), getattr(fresh, name)), name
    other = w.sampler(4).step(3)
    assert not np.array_equal(later.response_tokens, other.response_tokens)
    assert not np.array_equal(later.response_tokens, w.sampler(3).step(4).response_tokens)


def test_lengths_respect_their_bounds(workloads):
    for w in workloads.values():
        c = w.config
        s = w.sampler(0).step(0)
        assert s.prompt_tokens.shape == (128,) and s.response_tokens.shape == (2048,)
        for values, spec in (
            (s.prompt_tokens, c.prompt),
            (s.response_tokens, c.response),
            (s.judgment_tokens, c.judgment),
        ):
            assert values.min() >= spec.min and values.max() <= spec.max
        assert s.genrm_prompt_tokens.max() <= c.genrm_prompt.max_tokens
        assert np.array_equal(s.response_truncated, s.response_tokens == c.response.max)
        prompts = s.sequence_prompt_tokens
        untruncated = prompts + s.response_tokens + c.genrm_prompt.template_tokens
        assert np.array_equal(
            s.genrm_prompt_tokens, np.minimum(untruncated, c.genrm_prompt.max_tokens)
        )
        assert s.train_tokens == int(prompts.sum() + s.response_tokens.sum())


def test_response_lengths_are_long_tailed_around_the_stated_median(workloads):
    w = workloads["qwen2.5-7b_qwen3-30b-a3b"]
    spec = w.config.response
    lengths = np.concatenate([w.sampler(0).step(i).response_tokens for i in range(20)])
    assert np.median(lengths) == pytest.approx(spec.median, rel=0.1)
    assert lengths.mean() > 1.4 * np.median(lengths)  # a long right tail
    assert (lengths == spec.max).any()  # some reach the maximum
    # responses to one prompt share part of their log-length: per-prompt means spread more
    # than independent draws would (variance of a mean of 16 would be sigma^2 / 16)
    logs = np.log(lengths[: 128 * 16].reshape(128, 16))
    assert logs.mean(axis=1).var() > 3 * spec.sigma**2 / 16


def test_judgment_lengths_follow_response_lengths(workloads):
    w = workloads["qwen2.5-7b_qwen3-30b-a3b"]
    s = w.sampler(1).step(0)
    corr = np.corrcoef(np.log(s.response_tokens), np.log(s.judgment_tokens))[0, 1]
    assert 0.15 < corr < 0.45  # stated 0.3


def test_derived_capacity_and_prefill_rate_by_hand(workloads):
    w = workloads["qwen2.5-7b_qwen3-30b-a3b"]
    # (96e9 * 0.7 - 2 * 7.62e9) / 57344 and 0.5 * 148e12 / (2 * 7.62e9)
    assert w.kv_capacity_tokens(Role.ROLLOUT) == int((96e9 * 0.7 - 15.24e9) // 57344)
    assert w.prefill_tokens_per_s(Role.ROLLOUT) == pytest.approx(74e12 / 15.24e9)
    # the MoE GenRM prefills at its active parameters, on 4 devices
    assert w.prefill_tokens_per_s(Role.REWARD) == pytest.approx(4 * 74e12 / 6.6e9)


def test_a_sampled_step_runs_on_sim_engines(workloads):
    w = workloads["qwen2.5-1.5b_glm-z1-9b"]
    s = w.sampler(0).step(0)
    e = w.make_engine(Role.ROLLOUT, token_events=False)
    prompts = s.sequence_prompt_tokens
    for i in range(64):
        target = int(s.response_tokens[i])
        truncated = bool(s.response_truncated[i])
        e.add(i, [1] * int(prompts[i]), sampling=sim_sampling(target, truncated=truncated))
    lengths = {}
    while e.has_unfinished():
        for f in e.step(max_tokens=None).finished:
            lengths[f.seq_id] = len(f.token_ids)
    assert lengths == {i: int(s.response_tokens[i]) for i in range(64)}


def _write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "sim").mkdir()
    (tmp_path / "cost_models").symlink_to(ROOT / "configs" / "cost_models")
    path = tmp_path / "sim" / "bad.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ("median = 1500.0", "median = 99999.0", "response.median"),
        ('model = "qwen2.5-7b"', 'model = "qwen9-1t"', "policy.model"),
        ("layout = { tp = 4 }", "layout = { tp = 2 }", "genrm.layout"),
        ("gpu_memory_utilization = 0.7", "gpu_memory_utilization = 0.11", "policy.kv_capacity"),
        ("sigma = 1.0", "sigma = -1.0", "response.sigma"),
        ("template_tokens = 350", "template_tokenz = 350", "genrm_prompt.template_tokenz"),
    ],
)
def test_bad_configs_name_the_key(tmp_path, old, new, key):
    text = GROUP.read_text()
    assert old in text
    path = _write(tmp_path, text.replace(old, new, 1))
    with pytest.raises(ConfigError) as err:
        load_workload(path)
    assert key in str(err.value) and "bad.toml" in str(err.value)
