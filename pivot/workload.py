"""Simulated RL workloads: one config per model group (``configs/sim/*.toml``) and seeded
samplers of the lengths an RL step generates.

A workload says what runs (policy and GenRM: model, layout, size, KV footprint, engine limits),
on which accelerator, and how long things are: prompt lengths, response lengths (long-tailed,
clipped at the maximum response length), GenRM judgment lengths, the GenRM prompt built from
prompt + response. It does not say how many devices there are or how they are deployed: the
same file runs colocated, disaggregated, rollout-reward colocated and PivotRL at any size.

Lengths are lognormal, clipped to ``[min, max]``. Responses to one prompt share part of their
log-length (hard prompts get long answers): ``per_prompt_share`` of the log-variance is drawn
once per prompt. Judgment log-lengths correlate with the response's. Every draw of step ``s``
comes from its own stream seeded by ``(seed, s)``, so a step's lengths do not depend on which
steps were drawn before, and every deployment sees the same workload for the same seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import msgspec
import numpy as np

from pivot.cluster import ReplicaLayout, Role
from pivot.config import (
    ConfigError,
    ConfigStruct,
    Correlation,
    Fraction,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    UnitInterval,
    load_toml,
)
from pivot.engines.sim_engine import (
    Hardware,
    ShiftCostModel,
    ShiftCosts,
    SimInferenceEngine,
    SimTrainer,
    TrainerCosts,
    weight_bytes,
)
from pivot.planning.cost import CostModel, load_cost_models


class ModelSpec(ConfigStruct, kw_only=True):
    """One model as a role runs it. ``model`` names its file in the cost-model folder."""

    model: str
    layout: ReplicaLayout = ReplicaLayout()
    params_b: PositiveFloat  # total parameters, billions
    active_params_b: PositiveFloat | None = None  # per token (mixture of experts); None: dense
    kv_bytes_per_token: PositiveInt  # KV cache per token, whole model, bf16
    max_running: PositiveInt  # engine batch limit per replica
    gpu_memory_utilization: Fraction  # fraction of device memory the engine takes
    kv_capacity_tokens: PositiveInt | None = None  # None: derived from memory (see Workload)
    prefill_tokens_per_s: PositiveFloat | None = None  # None: derived from FLOP/s (see Workload)

    @property
    def active_b(self) -> float:
        return self.active_params_b if self.active_params_b is not None else self.params_b


class LengthSpec(ConfigStruct, kw_only=True):
    """Lognormal lengths in tokens, rounded and clipped to [min, max]."""

    median: PositiveFloat
    sigma: NonNegativeFloat  # of the natural log of the length
    min: PositiveInt = 1
    max: PositiveInt
    per_prompt_share: UnitInterval = 0.0  # of the log-variance, shared by the responses to a prompt


class JudgmentSpec(LengthSpec, kw_only=True):
    # correlation of a judgment's log-length with its response's (before clipping)
    response_correlation: Correlation = 0.0


class GenRMPromptSpec(ConfigStruct):
    """The GenRM's prompt: a fixed template around the policy's prompt and response."""

    template_tokens: PositiveInt
    max_tokens: PositiveInt  # longer GenRM prompts are truncated to this


class BatchSpec(ConfigStruct):
    prompts_per_step: PositiveInt = 128
    samples_per_prompt: PositiveInt = 16


class WorkloadConfig(ConfigStruct, kw_only=True):
    """A model group's workload, as written in ``configs/sim/<group>.toml``."""

    name: str
    description: str = ""
    cost_models: str = "../cost_models"  # folder of cost-model files, relative to this file
    hardware: Hardware = Hardware()
    policy: ModelSpec
    genrm: ModelSpec
    batch: BatchSpec = BatchSpec()
    prompt: LengthSpec
    response: LengthSpec
    judgment: JudgmentSpec
    genrm_prompt: GenRMPromptSpec
    trainer: TrainerCosts = TrainerCosts()
    shift: ShiftCosts = ShiftCosts()


@dataclass(frozen=True)
class StepLengths:
    """The lengths of one RL step. Sequence ``i`` answers prompt ``i // samples_per_prompt``."""

    step: int
    samples_per_prompt: int
    prompt_tokens: np.ndarray  # (prompts,)
    response_tokens: np.ndarray  # (prompts * samples,)
    response_truncated: np.ndarray  # (prompts * samples,) bool: clipped at the maximum
    judgment_tokens: np.ndarray  # (prompts * samples,)
    genrm_prompt_tokens: np.ndarray  # (prompts * samples,)

    @property
    def sequences(self) -> int:
        return int(self.response_tokens.size)

    @property
    def sequence_prompt_tokens(self) -> np.ndarray:
        """Prompt length of every sequence."""
        return np.repeat(self.prompt_tokens, self.samples_per_prompt)

    @property
    def train_tokens(self) -> int:
        """Tokens the trainer processes: prompt + response of every sequence."""
        return int(self.sequence_prompt_tokens.sum() + self.response_tokens.sum())


def _lengths(spec: LengthSpec, z: np.ndarray) -> np.ndarray:
    raw = np.rint(spec.median * np.exp(spec.sigma * z))
    return np.clip(raw, spec.min, spec.max).astype(np.int64)


class WorkloadSampler:
    """Seeded, order-independent samples of a workload's lengths."""

    def __init__(self, config: WorkloadConfig, seed: int) -> None:
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.config = config
        self.seed = seed

    def step(self, step: int) -> StepLengths:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        c = self.config
        prompts, samples = c.batch.prompts_per_step, c.batch.samples_per_prompt
        n = prompts * samples
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, step])))
        # a fixed draw order: the same (seed, step) gives the same lengths
        z_prompt = rng.standard_normal(prompts)
        z_shared = rng.standard_normal(prompts)
        z_own = rng.standard_normal(n)
        z_judge = rng.standard_normal(n)
        prompt_tokens = _lengths(c.prompt, z_prompt)
        share = c.response.per_prompt_share
        z_response = math.sqrt(share) * np.repeat(z_shared, samples) + math.sqrt(1 - share) * z_own
        response = _lengths(c.response, z_response)
        rho = c.judgment.response_correlation
        judgment = _lengths(c.judgment, rho * z_response + math.sqrt(1 - rho * rho) * z_judge)
        genrm_prompt = np.minimum(
            c.genrm_prompt.template_tokens + np.repeat(prompt_tokens, samples) + response,
            c.genrm_prompt.max_tokens,
        )
        return StepLengths(
            step=step,
            samples_per_prompt=samples,
            prompt_tokens=prompt_tokens,
            response_tokens=response,
            response_truncated=response >= c.response.max,
            judgment_tokens=judgment,
            genrm_prompt_tokens=genrm_prompt,
        )


class Workload:
    """A loaded workload: its config, the file it came from, and what it builds.

    Derived, when the config leaves them out (both ESTIMATES, the config says so):
    KV capacity = (memory * utilization * TP - bf16 weights) / KV bytes per token;
    prefill rate = prefill_mfu * peak FLOP/s * TP / (2 * active parameters).
    """

    def __init__(
        self, config: WorkloadConfig, source: str = "<workload>", base: Path | None = None
    ):
        self.config = config
        self.source = source
        self.cost_model_dir = (base or Path.cwd()) / config.cost_models
        self._check()

    def model(self, role: Role) -> ModelSpec:
        if role is Role.ROLLOUT:
            return self.config.policy
        if role is Role.REWARD:
            return self.config.genrm
        raise ValueError(f"a workload has models for rollout and reward, not {role.value!r}")

    @staticmethod
    def _section(role: Role) -> str:
        return "policy" if role is Role.ROLLOUT else "genrm"

    @cached_property
    def _cost_files(self):
        try:
            return load_cost_models(self.cost_model_dir)
        except ConfigError:
            raise
        except OSError as exc:  # pragma: no cover - an unreadable folder
            raise ConfigError(self.source, "cost_models", "a readable folder", str(exc)) from None

    def cost_model(self, role: Role) -> CostModel:
        spec = self.model(role)
        files = self._cost_files
        section = self._section(role)
        if spec.model not in files:
            have = ", ".join(sorted(files)) or "none"
            raise ConfigError(
                self.source,
                f"{section}.model",
                f"a model with a file in {self.cost_model_dir} ({have})",
                repr(spec.model),
            )
        fits = files[spec.model].layouts
        if spec.layout.key not in fits:
            raise ConfigError(
                self.source,
                f"{section}.layout",
                f"a layout {spec.model} has a fit for ({', '.join(sorted(fits))})",
                spec.layout.key,
            )
        fit = fits[spec.layout.key].cost_model()
        return msgspec.structs.replace(fit, prefill_tokens_per_s=self.prefill_tokens_per_s(role))

    def kv_capacity_tokens(self, role: Role) -> int:
        spec = self.model(role)
        if spec.kv_capacity_tokens is not None:
            return spec.kv_capacity_tokens
        hw = self.config.hardware
        memory = hw.memory_gb * 1e9 * spec.gpu_memory_utilization * spec.layout.size
        free = memory - weight_bytes(spec.params_b)
        return int(free // spec.kv_bytes_per_token)

    def prefill_tokens_per_s(self, role: Role) -> float:
        spec = self.model(role)
        if spec.prefill_tokens_per_s is not None:
            return spec.prefill_tokens_per_s
        return self.config.hardware.prefill_tokens_per_s(spec.active_b, spec.layout.tp)

    def _check(self) -> None:
        c = self.config
        for key in ("prompt", "response", "judgment"):
            spec: LengthSpec = getattr(c, key)
            if spec.min > spec.max:
                raise ConfigError(
                    self.source, f"{key}.min", f"<= {key}.max ({spec.max})", str(spec.min)
                )
            if not spec.min <= spec.median <= spec.max:
                raise ConfigError(
                    self.source,
                    f"{key}.median",
                    f"within [{spec.min}, {spec.max}]",
                    str(spec.median),
                )
        if c.prompt.per_prompt_share:
            raise ConfigError(
                self.source,
                "prompt.per_prompt_share",
                "0 (prompts are drawn once each)",
                str(c.prompt.per_prompt_share),
            )
        for role in (Role.ROLLOUT, Role.REWARD):
            section, spec = self._section(role), self.model(role)
            if spec.active_params_b is not None and spec.active_params_b > spec.params_b:
                raise ConfigError(
                    self.source,
                    f"{section}.active_params_b",
                    f"<= params_b ({spec.params_b})",
                    str(spec.active_params_b),
                )
            longest = (
                c.prompt.max + c.response.max
                if role is Role.ROLLOUT
                else c.genrm_prompt.max_tokens + c.judgment.max
            )
            capacity = self.kv_capacity_tokens(role)
            if capacity < longest:
                raise ConfigError(
                    self.source,
                    f"{section}.kv_capacity_tokens",
                    f"room for the longest sequence ({longest} tokens); weights may not fit",
                    str(capacity),
                )

    # ---- what it builds -----------------------------------------------------------------------

    def sampler(self, seed: int) -> WorkloadSampler:
        return WorkloadSampler(self.config, seed)

    def replica_sizes(self) -> dict[Role, int]:
        """Devices per replica of each inference role."""
        return {r: self.model(r).layout.size for r in (Role.ROLLOUT, Role.REWARD)}

    def make_engine(self, role: Role, *, seed: int = 0, **options) -> SimInferenceEngine:
        """A simulated replica of ``role`` (options go to SimInferenceEngine: itl_noise, ...)."""
        spec = self.model(role)
        return SimInferenceEngine(
            self.cost_model(role),
            max_running=spec.max_running,
            kv_capacity_tokens=self.kv_capacity_tokens(role),
            prefill_tokens_per_s=self.prefill_tokens_per_s(role),
            seed=seed,
            **options,
        )

    def shift_costs(self) -> ShiftCostModel:
        return ShiftCostModel(self.config.shift, self.config.trainer)

    def make_trainer(self, devices: int, *, version: int = 0) -> SimTrainer:
        return SimTrainer(
            params_b=self.config.policy.params_b,
            devices=devices,
            hardware=self.config.hardware,
            costs=self.config.trainer,
            shift=self.shift_costs(),
            version=version,
        )


def load_workload(path: str | Path) -> Workload:
    """Read and check ``configs/sim/<group>.toml``; cost models resolve relative to it."""
    p = Path(path)
    config = load_toml(p, WorkloadConfig)
    workload = Workload(config, str(p), p.parent)
    for role in (Role.ROLLOUT, Role.REWARD):
        workload.cost_model(role)  # a missing fit is an error now, not at the first replica
    return workload


def load_workloads(directory: str | Path) -> dict[str, Workload]:
    """Every ``*.toml`` in ``directory``, keyed by the ``name`` each gives."""
    out: dict[str, Workload] = {}
    for path in sorted(Path(directory).glob("*.toml")):
        w = load_workload(path)
        if w.config.name in out:
            raise ConfigError(str(path), "name", "a name no other workload uses", w.config.name)
        out[w.config.name] = w
    return out
