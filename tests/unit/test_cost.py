"""Cost model: the config files, the exact rewrite of the authors' form, and the online refit."""

import numpy as np
import pytest
from planner_cases import COST_MODELS

from pivot.cluster import ReplicaLayout
from pivot.config import ConfigError
from pivot.planning.cost import (
    CostModel,
    OnlineCostModel,
    cost_model_for,
    fit_cost_model,
    load_cost_model_file,
    load_cost_models,
)

TRUE = CostModel.from_measured(0.0064, 0.0027, 0.0001231, 0.0028, 3.35e-08)  # qwen2.5-7b TP1


def authors_itl(m, running, tokens):
    return (
        m.attn_latency_k * tokens
        + np.maximum(m.other_threshold, m.other_latency_b + m.other_latency_k * running)
        + m.attn_latency_b
    )


def test_every_file_loads_and_measured_fits_match_the_authors_formula():
    files = load_cost_models(COST_MODELS)
    assert {"qwen2.5-7b", "qwen3-30b-a3b", "qwen2.5-1.5b", "qwen2.5-72b"} <= set(files)
    running = np.arange(0, 600, 7, dtype=float)
    tokens = running * 3000.0
    measured = 0
    for name, f in files.items():
        assert f.source, name
        for key, fit in f.layouts.items():
            model = fit.cost_model()
            if fit.measured is None:
                assert f.estimate, f"{name} {key} has no measured fit and is not marked estimate"
                continue
            measured += 1
            want = authors_itl(fit.measured, running, tokens)
            np.testing.assert_allclose(model.itl(running, tokens), want, rtol=1e-9)
    assert measured == 8


def test_estimates_are_marked_and_say_how():
    for name in ("qwen2.5-1.5b", "qwen2.5-72b"):
        f = load_cost_model_file(COST_MODELS / f"{name}.toml")
        assert f.estimate and f.derivation
        assert all(fit.measured is None for fit in f.layouts.values())


def test_a_smaller_model_is_cheaper_per_step():
    small = cost_model_for(COST_MODELS, "qwen2.5-1.5b", ReplicaLayout(tp=1))
    base = cost_model_for(COST_MODELS, "qwen2.5-7b", ReplicaLayout(tp=1))
    assert small.itl_one(64, 64 * 3000) < base.itl_one(64, 64 * 3000)


def test_missing_layout_and_bad_key_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="layouts.TP8_PP1"):
        cost_model_for(COST_MODELS, "qwen2.5-7b", ReplicaLayout(tp=8))
    with pytest.raises(ConfigError, match="cost-model file for 'nope'"):
        cost_model_for(COST_MODELS, "nope", ReplicaLayout())
    bad = tmp_path / "bad.toml"
    bad.write_text('model = "m"\nsource = "s"\n[layouts.TP1]\na = 0\nb = 0\nc = 0\nd = 0\n')
    with pytest.raises(ConfigError, match="layout key like TP4_PP1"):
        load_cost_model_file(bad)
    bad.write_text('model = "m"\nsource = "s"\n[layouts.TP1_PP1]\na = -1\nb = 0\nc = 0\nd = 0\n')
    with pytest.raises(ConfigError, match=r"layouts.*\.a.*>= 0\.0"):
        load_cost_model_file(bad)


def test_itl_formula_and_throughput():
    m = CostModel(a=1e-8, b=0.004, c=1e-4, d=0.002)
    assert m.itl_one(10, 1e5) == pytest.approx(1e-3 + 0.004 + 0.002)  # flat regime
    assert m.itl_one(100, 1e5) == pytest.approx(1e-3 + 0.01 + 0.002)  # linear regime
    assert m.throughput_one(100, 1e5) == pytest.approx(100 / 0.013)
    assert m.throughput_one(0, 0) == 0.0
    np.testing.assert_allclose(
        m.throughput(np.array([0, 100]), np.array([0, 1e5])), [0.0, 100 / 0.013]
    )


def samples(model, n, rng, noise=0.02):
    running = rng.integers(1, 257, n)
    tokens = running * rng.uniform(500, 8000, n)
    itl = model.itl(running, tokens) * (1 + noise * rng.standard_normal(n))
    return running, tokens, itl


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_refit_converges_from_a_wrong_prior(seed):
    rng = np.random.default_rng(seed)
    wrong = CostModel(a=TRUE.a * 4, b=TRUE.b * 0.2, c=TRUE.c * 3, d=TRUE.d * 0.5)
    fit = fit_cost_model(*samples(TRUE, 400, rng), prior=wrong)
    for name, tol in (("a", 0.05), ("b", 0.10), ("c", 0.05), ("d", 0.05)):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=tol), name
    grid = np.arange(1, 257)
    for per_seq in (500, 4000, 8000):
        np.testing.assert_allclose(
            fit.itl(grid, grid * per_seq), TRUE.itl(grid, grid * per_seq), rtol=0.02
        )


def test_refit_keeps_what_the_data_cannot_see_at_the_prior():
    # every sample in the flat regime (running <= 20 < B/C = 30): C is not identifiable
    rng = np.random.default_rng(3)
    running = rng.integers(1, 21, 300)
    tokens = running * rng.uniform(500, 8000, 300)
    itl = TRUE.itl(running, tokens)
    fit = fit_cost_model(running, tokens, itl, prior=TRUE)
    np.testing.assert_allclose(fit.itl(running, tokens), itl, rtol=1e-3)
    assert fit.c * 20 <= fit.b + 1e-12  # the unseen slope cannot take over the seen regime


def test_online_model_refits_after_enough_samples_and_forgets_old_ones():
    rng = np.random.default_rng(4)
    online = OnlineCostModel(prior=TRUE, window=300, min_samples=50)
    other = CostModel(a=TRUE.a * 2, b=TRUE.b * 1.5, c=TRUE.c * 2, d=TRUE.d * 1.2)
    for r, t, y in zip(*samples(other, 40, rng), strict=True):
        online.observe(r, t, y)
    online.observe(0, 0, 0.01)  # an idle replica says nothing
    online.observe(5, 100, -1.0)
    assert online.samples == 40 and online.refit() is TRUE  # below min_samples: the prior
    for r, t, y in zip(*samples(other, 600, rng), strict=True):
        online.observe(r, t, y)
    assert online.samples == 300
    assert online.refit().c == pytest.approx(other.c, rel=0.05)


def test_online_error_measures_the_miss_and_a_refit_keeps_the_prefill_rate():
    rng = np.random.default_rng(5)
    prior = CostModel(a=TRUE.a, b=TRUE.b, c=TRUE.c, d=TRUE.d, prefill_tokens_per_s=2e4)
    online = OnlineCostModel(prior=prior)
    assert online.error() == 0.0 and online.fresh == 0
    slower = CostModel(a=TRUE.a * 1.2, b=TRUE.b * 1.2, c=TRUE.c * 1.2, d=TRUE.d * 1.2)
    for r, t, y in zip(*samples(slower, 100, rng, noise=0.0), strict=True):
        online.observe(r, t, y)
    assert online.fresh == 100
    assert online.error() == pytest.approx(1 - 1 / 1.2)  # the prior is 1.2x too fast
    fit = online.refit()
    assert online.fresh == 0 and online.error() < 1e-6
    assert fit.prefill_tokens_per_s == 2e4 and fit.prefill_s(1e4) == pytest.approx(0.5)
    assert CostModel(1, 1, 1, 1).prefill_s(1e4) == 0.0  # no rate known: unpriced
