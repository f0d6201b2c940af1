"""A toy workload whose timings can be worked out by hand: every step of every replica costs
``itl`` seconds whatever it runs (cost model a = c = d = 0), prefill is all but free, and with
``sigma = 0`` every response and judgment has exactly its median length. The config is also
written to ``<folder>/toy.toml``. ``per_running``
makes a step slower with more sequences (ITL = max(itl, per_running * running)): then the
planner gains by spreading sequences over more replicas. ``policy_params_b``: the policy's size,
what its weight loads cost (the default's are ~1e-4 s). ``hardware``: ``[hardware]`` keys (a
slow one makes training long against inference). ``genrm_prefill_tokens_per_s``: the GenRM's
prefill rate (a slow one stalls a replica's batch for every new judgment)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from pivot.workload import Workload, WorkloadConfig

ITL = 0.01


def _cost_model(name: str, itl: float, per_running: float) -> str:
    fits = "".join(
        f"[layouts.TP{tp}_PP1]\na = 0.0\nb = {itl}\nc = {per_running}\nd = 0.0\n"
        for tp in (1, 2, 4)
    )
    return f'model = "{name}"\nsource = "tests/sim/toy.py"\nestimate = true\n{fits}'


def toy_workload(
    folder: Path,
    *,
    prompts: int = 1,
    samples: int = 2,
    prompt: int = 10,
    response: int = 100,
    judgment: int = 50,
    sigma: float = 0.0,
    reward_tp: int = 1,
    fixed_step_s: float = 2.0,
    itl: float = ITL,
    per_running: float = 0.0,
    max_running: int = 64,
    policy_params_b: float = 0.001,
    hardware: dict[str, Any] | None = None,
    genrm_prefill_tokens_per_s: float = 1e9,
) -> Workload:
    models = folder / "cost_models"
    models.mkdir(parents=True, exist_ok=True)
    for name in ("toy-policy", "toy-genrm"):
        (models / f"{name}.toml").write_text(_cost_model(name, itl, per_running))

    def model(name: str, tp: int, params_b: float = 0.001, prefill: float = 1e9) -> dict[str, Any]:
        return {
            "model": name,
            "layout": {"tp": tp},
            "params_b": params_b,
            "kv_bytes_per_token": 1,
            "max_running": max_running,
            "gpu_memory_utilization": 0.5,
            "kv_capacity_tokens": 1_000_000,
            "prefill_tokens_per_s": prefill,
        }

    def lengths(median: int, max_: int, share: float = 0.0) -> dict[str, Any]:
        spec = {"median": median, "sigma": sigma, "min": 1, "max": max_}
        if share:
            spec["per_prompt_share"] = share
        return spec

    raw = {
        "name": "toy",
        "cost_models": "cost_models",
        "policy": model("toy-policy", 1, policy_params_b),
        "genrm": model("toy-genrm", reward_tp, prefill=genrm_prefill_tokens_per_s),
        "batch": {"prompts_per_step": prompts, "samples_per_prompt": samples},
        "prompt": {"median": prompt, "sigma": 0.0, "min": 1, "max": 100},
        "response": lengths(response, 20 * response),
        "judgment": lengths(judgment, 20 * judgment),
        "genrm_prompt": {"template_tokens": 10, "max_tokens": 100_000},
        "trainer": {"fixed_step_s": fixed_step_s, "wake_s": 1.0, "offload_s": 0.5},
        "shift": {"abort_s": 0.1, "engine_release_s": 0.2, "engine_wake_s": 0.3, "register_s": 0.1},
    }
    if hardware:
        raw["hardware"] = hardware
    (folder / "toy.toml").write_text(_toml(raw))
    return Workload(msgspec.convert(raw, WorkloadConfig), str(folder / "toy.toml"), folder)


def _toml(raw: dict[str, Any]) -> str:
    """The toy config as TOML (``toy.toml`` beside its cost models), for the command line."""

    def value(v: Any) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        if isinstance(v, str):
            return f'"{v}"'
        return repr(v)

    lines = [f"{k} = {value(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for key, table in raw.items():
        if isinstance(table, dict):
            lines.append(f"[{key}]")
            lines.extend(f"{k} = {value(v)}" for k, v in table.items())
    return "\n".join(lines) + "\n"
