"""Where a job's tensors live (``pivot.accelerator``): the device, dtype and process-group
backend chosen from the config, job devices sharing GPUs (the trainer's ranks, each SGLang
engine's memory share), and the reasons a host cannot run a CUDA config; checked without a
GPU."""

from __future__ import annotations

import os

import pytest
import torch

from pivot.accelerator import cuda_missing, device_cores, dist_backend, place, torch_device
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


def _job(toml: str) -> JobConfig:
    return decode_toml(toml, JobConfig, "j.toml").validate("j.toml")


ONE_GPU = '[cluster]\naccelerator = "cuda"\ngpus = [0, 0, 0, 0]\n[model]\nengine = "sglang"\n'


def test_job_devices_on_one_gpu_split_it_among_the_sglang_engines_after_the_trainers_share():
    layout = _job(ONE_GPU).layout()  # pivot: 4 agents, each keeping a rollout and a GenRM engine
    assert layout.gpus == (0, 0, 0, 0) and [layout.gpu(d) for d in range(4)] == [0, 0, 0, 0]
    # devices 2 and 3 are the trainer's; NCCL takes one rank per GPU, on the first of them
    assert layout.trainer_devices == (2,) and layout.trainer_gpus == [0]
    assert layout.mem_fraction == {d: round((0.8 - 0.3) / 8, 4) for d in range(4)}
    no_trainer_share = place(
        "cuda",
        3,
        trainer_devices=(2,),
        engines={0: 1, 1: 1},
        gpus=(0, 0, 1),
        mem_fraction_static=0.9,
    )
    assert no_trainer_share.mem_fraction == {0: 0.45, 1: 0.45}  # the trainer has GPU 1


def test_job_devices_spread_over_gpus_give_the_trainer_a_rank_on_each_of_its_gpus():
    layout = _job(ONE_GPU.replace("[0, 0, 0, 0]", "[0, 1, 0, 1]")).layout()
    assert layout.trainer_devices == (2, 3) and layout.trainer_gpus == [0, 1]
    assert set(layout.mem_fraction.values()) == {round(0.5 / 4, 4)}
    # without cluster.gpus device N is GPU N, one rank per trainer device, as before
    plain = _job(ONE_GPU.replace("gpus = [0, 0, 0, 0]\n", "")).layout()
    assert plain.gpus == (0, 1, 2, 3) and plain.trainer_devices == (2, 3)
    assert plain.mem_fraction == {0: 0.4, 1: 0.4, 2: 0.25, 3: 0.25}
    torch_engine = _job(ONE_GPU.replace('engine = "sglang"', 'engine = "torch"')).layout()
    assert torch_engine.mem_fraction == {} and torch_engine.trainer_devices == (2,)
    cpu = _job("").layout()
    assert (cpu.gpus, cpu.trainer_devices, cpu.trainer_gpus, cpu.gpu(1)) == ((), (2, 3), None, None)


@pytest.mark.parametrize(
    ("toml", "key", "expected", "found"),
    [
        ("[cluster]\ngpus = [0, 0, 0, 0]\n", "cluster.gpus", "cluster.accelerator = 'cuda'", "[0"),
        (
            ONE_GPU.replace("0, 0, 0, 0", "0, 0"),
            "cluster.gpus",
            "one GPU index per job device (4",
            "2 indices",
        ),
        (ONE_GPU.replace("0, 0, 0, 0", "0, 0, -1, 0"), "cluster.gpus[2]", "int >= 0", "-1"),
        (
            ONE_GPU + "mem_fraction_static = 0.3\n",
            "cluster.trainer_gpu_fraction",
            "less than model.mem_fraction_static = 0.3, on GPU 0 with a trainer rank and 8 SGLang",
            "float 0.3",
        ),
    ],
)
def test_a_gpu_layout_that_cannot_work_is_refused_naming_its_key(toml, key, expected, found):
    with pytest.raises(ConfigError) as err:
        _job(toml)
    assert err.value.key == key and expected in err.value.expected and found in err.value.found


def test_cluster_gpus_may_name_only_the_gpus_this_host_has():
    facts = {"available": True, "count": 1, "cpu_build": False}
    assert cuda_missing("cuda", 4, gpus=(0, 0, 0, 0), **facts) is None
    key, expected, found = cuda_missing("cuda", 4, gpus=(0, 0, 1, 1), **facts)
    assert key == "cluster.gpus" and "below the 1 CUDA devices here" in expected
    assert found == "GPU 1 in [0, 0, 1, 1]"


def test_a_trainer_rank_on_cuda_tells_deepspeed_its_gpu_as_its_local_rank(monkeypatch):
    import torch.distributed as dist

    from pivot.actors.trainer_deepspeed import init_process_group

    joined = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: joined.append(kw["rank"]))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    # DeepSpeed's engine moves to cuda:LOCAL_RANK whatever device the rank set
    init_process_group(0, 2, "file:///x", backend="nccl", gpu=3)
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"]) == ("0", "3")
    init_process_group(1, 2, "file:///x")
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"]) == ("1", "1") and joined == [0, 1]
