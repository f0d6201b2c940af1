"""Where a job's tensors live (``pivot.accelerator``): the device, dtype and process-group
backend chosen from the config, and the reasons a host cannot run a CUDA config; checked
without a GPU."""

from __future__ import annotations

import pytest
import torch

from pivot.accelerator import cuda_missing, device_cores, dist_backend, torch_device
from pivot.config import ConfigError, decode_toml
from pivot.job import JobConfig


def test_a_job_device_is_a_gpu_index_on_cuda_and_the_host_on_cpu():
    assert torch_device("cpu", 3) == "cpu"
    assert torch_device("cuda", 3) == "cuda:3"
    assert torch_device("cuda", None) == "cuda:0"


def test_pinned_devices_get_disjoint_contiguous_shares_of_the_cores():
    # fewer cores than devices: neighbours share a core
    assert [device_cores(d, 4, [0, 1]) for d in range(4)] == [(0,), (0,), (1,), (1,)]
    # more: each device its own block, the remainder unused; the host's core ids are kept
    assert [device_cores(d, 2, [2, 3, 5, 7, 9]) for d in range(2)] == [(2, 3), (5, 7)]
    with pytest.raises(ValueError, match="device 4 is not one of 4"):
        device_cores(4, 4, [0, 1])
    gpu = decode_toml('[cluster]\naccelerator = "cuda"\npin_cores = true\n', JobConfig, "j.toml")
    with pytest.raises(ConfigError) as err:
        gpu.validate("j.toml")
    assert err.value.key == "cluster.pin_cores"


def test_the_trainer_group_is_nccl_on_cuda_and_gloo_on_cpu():
    assert dist_backend("cuda") == "nccl"
    assert dist_backend("cpu") == "gloo"


def test_a_cuda_config_names_what_the_host_lacks():
    facts = {"available": False, "count": 0, "cpu_build": True}
    assert cuda_missing("cpu", 4, **facts) is None
    key, expected, found = cuda_missing("cuda", 4, **facts)
    assert key == "cluster.accelerator" and "torch.cuda.is_available()" in expected
    assert found == "none: this torch is the CPU build"
    _, _, found = cuda_missing("cuda", 4, **{**facts, "cpu_build": False})
    assert "no GPU" in found
    key, expected, found = cuda_missing("cuda", 4, available=True, count=2, cpu_build=False)
    assert (key, found) == ("cluster.devices", "int 4") and "2 CUDA devices" in expected
    assert cuda_missing("cuda", 2, available=True, count=2, cpu_build=False) is None


def test_bfloat16_needs_cuda():
    cpu = decode_toml('[model]\ndtype = "bfloat16"\n', JobConfig, "j.toml")
    with pytest.raises(ConfigError) as err:
        cpu.validate("j.toml")
    assert err.value.key == "model.dtype" and "cuda" in err.value.expected
    gpu = decode_toml(
        '[cluster]\naccelerator = "cuda"\n[model]\ndtype = "bfloat16"\n', JobConfig, "j.toml"
    )
    assert gpu.validate("j.toml").model.dtype == "bfloat16"


def test_the_deepspeed_config_adds_bf16_only_when_asked():
    from pivot.actors.trainer_deepspeed import deepspeed_config
    from pivot.training import TrainingSettings

    fp32 = deepspeed_config(TrainingSettings())
    assert "bf16" not in fp32 and "fp16" not in fp32
    bf16 = deepspeed_config(TrainingSettings(), bf16=True)
    assert bf16["bf16"] == {"enabled": True}
    assert {k: v for k, v in bf16.items() if k != "bf16"} == fp32


def test_the_agent_builds_its_torch_engines_on_the_device_and_dtype_it_is_given():
    from pivot.actors.agent import engines_for
    from pivot.assets import ASSETS

    folder = ASSETS / "tiny-policy"
    engines, _ = engines_for(
        {"rollout": folder}, {}, reader_name="a", accelerator="cpu", dtype="bfloat16"
    )
    engine = engines["rollout"]
    assert (engine.device, engine.dtype) == (torch.device("cpu"), torch.bfloat16)
    logits = engine.prompt_logits([1, 2, 3])
    assert logits.dtype == torch.float32 and logits.device.type == "cpu"


def test_each_trainer_rank_is_told_its_gpu_on_cuda_and_none_on_cpu(tmp_path):
    from pivot.actors.trainer_deepspeed import trainer_group, trainer_names
    from pivot.bus import Directory

    directory = Directory.ipc(tmp_path, trainer_names("trainer", 2))

    def ranks(**where):
        group = trainer_group(
            "trainer", directory=directory, checkpoint="c", world_size=2, run_dir=tmp_path, **where
        )
        return {c.kwargs["rank"]: (c.kwargs["accelerator"], c.kwargs["gpu"]) for _, c in group}

    assert ranks() == {0: ("cpu", None), 1: ("cpu", None)}
    assert ranks(accelerator="cuda", gpus=[2, 3]) == {0: ("cuda", 2), 1: ("cuda", 3)}
