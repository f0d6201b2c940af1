"""The memory estimate of a job, part by part, on made-up models (pivot.memory)."""

from __future__ import annotations

import math
from pathlib import Path

from pivot.cluster import Role
from pivot.config import decode_toml, load_toml
from pivot.engines.checkpoint import ModelShape, decoder_parameters, model_shape
from pivot.job import JobConfig
from pivot.memory import (
    AGENT_RUNTIME,
    MAIN_RUNTIME,
    STORE_COPIES,
    TRAINER_RUNTIME,
    GiB,
    estimate_memory,
)

POLICY = ModelShape(
    parameters=1000,
    layers=2,
    hidden_size=8,
    intermediate_size=16,
    heads=2,
    kv_heads=1,
    head_dim=4,
    vocab_size=10,
    max_positions=16,
)
GENRM = ModelShape(
    parameters=500,
    layers=1,
    hidden_size=8,
    intermediate_size=8,
    heads=2,
    kv_heads=2,
    head_dim=4,
    vocab_size=12,
    max_positions=8,
)


def _job(*lines: str) -> JobConfig:
    base = [
        "cluster.devices=3",
        "cluster.trainer_devices=1",
        "deployment.kind=disaggregated",
        "model.max_running=3",
        "training.micro_batch_size=2",
        "training.kl_coef=0.1",
    ]
    return decode_toml("", JobConfig, "job.toml", [*base, *lines])


def test_each_part_of_the_estimate_by_hand() -> None:
    # disaggregated, 3 devices: one rollout agent, one GenRM agent, one trainer rank
    estimate = estimate_memory(_job(), {Role.ROLLOUT: POLICY, Role.REWARD: GENRM})
    assert estimate.parts == {
        "process runtimes": MAIN_RUNTIME + 2 * AGENT_RUNTIME + TRAINER_RUNTIME,
        # rollout: its engine, the checkpoint's tensors, the read buffers; the GenRM: its
        # engine and its checkpoint's tensors (kept for shifts to reward)
        "inference weights": 3 * 1000 * 4 + 2 * 500 * 4,
        # max_running 3 x positions x (layers x k,v x kv_heads x head_dim x 4 bytes)
        "KV caches": 3 * 16 * (2 * 2 * 1 * 4 * 4) + 3 * 8 * (1 * 2 * 2 * 4 * 4),
        # 3 x positions tokens x (2 hidden + q,k,v + 2 intermediate + heads x positions + vocab)
        "inference activations": 3 * 16 * (16 + 16 + 32 + 32 + 10) * 4
        + 3 * 8 * (16 + 24 + 16 + 16 + 12) * 4,
        "trainer weights": 4000,  # one rank, ZeRO-2: whole
        "trainer gradients": 4000,
        "trainer optimizer states": 3 * 4000,  # fp32 copy and two Adam moments
        "reference policy": 4000,  # kl_coef > 0
        # micro-batch 2 x 16 positions x (2 layers x (10 x 8 + 4 x 16 + 2 x 2 x 16) + 3 x 10)
        "trainer activations": 2 * 16 * (2 * (80 + 64 + 64) + 30) * 4,
        "GPS store": STORE_COPIES * 4000,
    }
    assert estimate.total == sum(estimate.parts.values())
    assert estimate.largest(1) == [("process runtimes", estimate.parts["process runtimes"])]


def test_zero_3_partitions_the_weights_and_gradients_over_the_ranks() -> None:
    models = {Role.ROLLOUT: POLICY, Role.REWARD: GENRM}
    stage2 = estimate_memory(_job("cluster.devices=4", "cluster.trainer_devices=2"), models)
    stage3 = estimate_memory(
        _job("cluster.devices=4", "cluster.trainer_devices=2", "training.zero_stage=3"), models
    )
    assert stage2.parts["trainer weights"] == 2 * 4000
    assert stage3.parts["trainer weights"] == 2 * (4000 // 2)
    assert stage3.parts["trainer gradients"] == 4000
    # the optimizer states are partitioned at every stage: 3 copies of the weights in all
    assert stage2.parts["trainer optimizer states"] == stage3.parts["trainer optimizer states"]


def test_the_parameter_count_from_config_matches_the_weight_file() -> None:
    from safetensors import safe_open

    from pivot.assets import ASSETS
    from pivot.engines.checkpoint import inspect_checkpoint

    folder = ASSETS / "tiny-policy"
    spec, [weights] = inspect_checkpoint(folder)
    with safe_open(str(weights), framework="numpy") as f:
        in_file = sum(math.prod(f.get_slice(n).get_shape()) for n in f.keys())  # noqa: SIM118
    assert decoder_parameters(spec) == in_file == model_shape(folder).parameters


def test_the_tiny_job_fits_a_24_gib_machine_with_room() -> None:
    from pivot.assets import ASSETS

    job = load_toml(Path(__file__).parents[2] / "configs" / "tiny.toml", JobConfig)
    tiny = model_shape(ASSETS / "tiny-policy")
    estimate = estimate_memory(job, {Role.ROLLOUT: tiny, Role.REWARD: tiny})
    assert estimate.total < 8 * GiB


def test_a_fallback_models_shape_comes_from_its_headers_and_configs_own_names(tmp_path) -> None:
    """A model pivot's engine does not serve: its parameters are counted from the weight
    files' headers, its sizes read under the names its config uses (GPT-2's n_embd...)."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "architectures": ["GPT2LMHeadModel"],
                "n_embd": 16,
                "n_layer": 3,
                "n_head": 4,
                "n_positions": 64,
                "vocab_size": 50,
                "eos_token_id": 0,
            }
        )
    )
    save_file(
        {"wte": np.zeros((50, 16), np.float32), "h.0.w": np.zeros((16, 48), np.float16)},
        str(tmp_path / "model.safetensors"),
    )
    assert model_shape(tmp_path) == ModelShape(
        parameters=50 * 16 + 16 * 48,
        layers=3,
        hidden_size=16,
        intermediate_size=4 * 16,  # GPT-2 leaves n_inner out: 4 x hidden
        heads=4,
        kv_heads=4,
        head_dim=4,
        vocab_size=50,
        max_positions=64,
    )
