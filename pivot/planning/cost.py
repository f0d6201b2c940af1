"""The per-replica decode cost model, its config files, and its online refit.

Inter-token latency of a replica with ``running`` sequences holding ``tokens`` tokens in all:

    ITL = A * tokens + max(B, C * running) + D        (seconds; floored at 1e-9)

and its throughput is ``running / ITL`` tokens per second. Coefficients live per model and
layout in ``configs/cost_models/*.toml``; ``OnlineCostModel`` refits them from observed
(running, tokens, ITL) samples by bounded least squares, so that a wrong prior converges to
what the replicas measure. A model may also carry the replica's prefill rate (the workload
states it), which prices re-prefilling a moved sequence's context; the refit keeps it.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import msgspec
import numpy as np

from pivot.cluster import ReplicaLayout
from pivot.config import ConfigError, ConfigStruct, NonNegativeFloat, load_toml

ITL_FLOOR_S = 1e-9

_LAYOUT_KEY = re.compile(r"^TP[1-9][0-9]*_PP[1-9][0-9]*$")


class CostModel(msgspec.Struct, frozen=True):
    """``ITL = a*tokens + max(b, c*running) + d``; all four in seconds (per token, per sequence).

    ``prefill_tokens_per_s``: the replica's prefill rate; 0 when not known (a config file's
    fit alone does not say), and then re-prefilling is not priced."""

    a: float
    b: float
    c: float
    d: float
    prefill_tokens_per_s: float = 0.0

    def prefill_s(self, tokens):
        """Seconds to prefill ``tokens`` (vectorised); 0 when the rate is not known."""
        rate = self.prefill_tokens_per_s
        return tokens / rate if rate > 0 else tokens * 0.0

    @classmethod
    def from_measured(
        cls,
        other_threshold: float,
        other_latency_b: float,
        other_latency_k: float,
        attn_latency_b: float,
        attn_latency_k: float,
    ) -> CostModel:
        """The authors' fitted form, rewritten exactly into ours.

        ``max(thr, ob + ok*r) = ob + max(thr - ob, ok*r)``, and for r >= 0 a negative
        ``thr - ob`` never wins against ``ok*r``, so B = max(0, thr - ob) keeps the identity.
        """
        return cls(
            a=attn_latency_k,
            b=max(0.0, other_threshold - other_latency_b),
            c=other_latency_k,
            d=attn_latency_b + other_latency_b,
        )

    def itl(self, running, tokens):
        """Vectorised ITL in seconds; ``running`` and ``tokens`` may be numpy arrays."""
        return np.maximum(
            self.a * tokens + np.maximum(self.b, self.c * running) + self.d, ITL_FLOOR_S
        )

    def itl_one(self, running: float, tokens: float) -> float:
        return max(self.a * tokens + max(self.b, self.c * running) + self.d, ITL_FLOOR_S)

    def tokens_at(self, running, itl_s):
        """The KV tokens at which ``running`` sequences decode at ``itl_s`` (``itl``
        inverted; vectorised). Needs ``a > 0``: without it ITL says nothing of the tokens."""
        return (itl_s - np.maximum(self.b, self.c * running) - self.d) / self.a

    def throughput(self, running, tokens):
        """Decode tokens per second of replicas; 0 where nothing runs."""
        return running / self.itl(running, tokens)

    def throughput_one(self, running: float, tokens: float) -> float:
        return running / self.itl_one(running, tokens) if running > 0 else 0.0


class MeasuredFit(ConfigStruct):
    """The authors' coefficient names, kept verbatim so a file can be traced to its source."""

    other_threshold: NonNegativeFloat
    other_latency_b: NonNegativeFloat
    other_latency_k: NonNegativeFloat
    attn_latency_b: NonNegativeFloat
    attn_latency_k: NonNegativeFloat

    def cost_model(self) -> CostModel:
        return CostModel.from_measured(
            self.other_threshold,
            self.other_latency_b,
            self.other_latency_k,
            self.attn_latency_b,
            self.attn_latency_k,
        )


class LayoutFit(ConfigStruct):
    a: NonNegativeFloat
    b: NonNegativeFloat
    c: NonNegativeFloat
    d: NonNegativeFloat
    measured: MeasuredFit | None = None

    def cost_model(self) -> CostModel:
        return CostModel(a=self.a, b=self.b, c=self.c, d=self.d)


class CostModelFile(ConfigStruct, kw_only=True):
    """One model's fits, keyed by layout (``TP{tp}_PP{pp}``)."""

    model: str
    source: str
    estimate: bool = False
    derivation: str = ""
    layouts: dict[str, LayoutFit]

    def for_layout(self, layout: ReplicaLayout, source: str = "<cost model>") -> CostModel:
        fit = self.layouts.get(layout.key)
        if fit is None:
            have = ", ".join(sorted(self.layouts)) or "none"
            raise ConfigError(source, f"layouts.{layout.key}", f"a fit for {self.model}", have)
        return fit.cost_model()


def load_cost_model_file(path: str | Path) -> CostModelFile:
    loaded = load_toml(path, CostModelFile)
    for key in loaded.layouts:
        if not _LAYOUT_KEY.match(key):
            raise ConfigError(str(path), f"layouts.{key}", "a layout key like TP4_PP1", repr(key))
    if not loaded.layouts:
        raise ConfigError(str(path), "layouts", "at least one layout", "none")
    return loaded


def load_cost_models(directory: str | Path) -> dict[str, CostModelFile]:
    """Every ``*.toml`` in ``directory``, keyed by the ``model`` each names."""
    files: dict[str, CostModelFile] = {}
    for path in sorted(Path(directory).glob("*.toml")):
        loaded = load_cost_model_file(path)
        if loaded.model in files:
            raise ConfigError(str(path), "model", "a model no other file names", loaded.model)
        files[loaded.model] = loaded
    return files


def cost_model_for(directory: str | Path, model: str, layout: ReplicaLayout) -> CostModel:
    files = load_cost_models(directory)
    if model not in files:
        have = ", ".join(sorted(files)) or "none"
        raise ConfigError(str(directory), "model", f"a cost-model file for {model!r}", have)
    return files[model].for_layout(layout, str(directory))


# --- online refit --------------------------------------------------------------------------


def _face_masks() -> np.ndarray:
    faces = [s for n in range(1, 5) for s in itertools.combinations(range(4), n)]
    masks = np.zeros((len(faces), 4), dtype=bool)
    for i, face in enumerate(faces):
        masks[i, list(face)] = True
    return masks


_FACES = _face_masks()


def _nonneg_quadratic_min(gram: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Per problem p: argmin x'G_p x - 2h_p'x subject to x >= 0, for 4 variables: try every
    face, keep the best. ``gram`` (P, 4, 4), ``rhs`` (P, 4) -> (P, 4).

    With G positive definite the optimum solves the unconstrained system on some face; there
    are only 15 faces, so solving them all (one batched call) is exact and needs no tolerance.
    """
    free = _FACES  # (F, 4)
    pair = free[:, :, None] & free[:, None, :]
    # variables off the face are pinned to 0 by an identity row and a zero right-hand side
    pinned = np.where(~free, 1.0, 0.0)[:, :, None] * np.eye(4)
    systems = np.where(pair[None], gram[:, None], 0.0) + pinned[None]
    x = np.linalg.solve(systems, np.where(free[None], rhs[:, None], 0.0)[..., None])[..., 0]
    value = np.einsum("pfi,pij,pfj->pf", x, gram, x) - 2.0 * np.einsum("pfi,pi->pf", x, rhs)
    value[np.any(x < 0.0, axis=2)] = np.inf
    best = np.argmin(value, axis=1)
    out = x[np.arange(len(x)), best]
    out[value[np.arange(len(x)), best] >= 0.0] = 0.0
    return out


def fit_cost_model(
    running: np.ndarray,
    tokens: np.ndarray,
    itl: np.ndarray,
    prior: CostModel,
    prior_weight: float = 1e-4,
) -> CostModel:
    """Bounded (coefficients >= 0) least squares of relative ITL error; ``prior`` breaks ties.

    The max() is handled by a search over the regime split: samples with running <= tau are
    taken as flat (B), the others as linear (C*running); each split is a 4-variable
    non-negative least-squares problem. The split is searched coarsely on quantiles of the
    observed running counts, then finely between the best split's neighbours, and every
    split is scored by the residual of the true max() formula. ``prior_weight`` (in samples)
    is a tie-breaker: it keeps coefficients the data cannot identify (say B when every sample
    is linear) at the prior. It must stay tiny: running and tokens grow together, so A and C
    are told apart along a weak direction that a pull of even one sample would bias.

    Every split of a pass is solved at once: with the samples sorted by running count, a
    split's normal equations are a prefix sum of the flat samples' outer products plus a
    suffix sum of the linear ones'.
    """
    r = np.asarray(running, dtype=np.float64)
    t = np.asarray(tokens, dtype=np.float64)
    y = np.asarray(itl, dtype=np.float64)
    ok = (r > 0) & (y > 0) & np.isfinite(y) & (t >= 0)
    r, t, y = r[ok], t[ok], y[ok]
    if r.size == 0:
        return prior
    order = np.argsort(r, kind="stable")
    r, t, y = r[order], t[order], y[order]
    w = 1.0 / y  # relative error: ITL noise is multiplicative
    theta0 = np.array([prior.a, prior.b, prior.c, prior.d])
    # scale each coefficient by its feature's typical size, so the pull toward the prior is
    # comparable across coefficients and the normal equations are well conditioned
    scale = np.array(
        [
            max(float(np.sqrt(np.mean(t * t))), 1.0),
            1.0,
            max(float(np.sqrt(np.mean(r * r))), 1.0),
            1.0,
        ]
    )
    reg = prior_weight * np.mean(w * w)
    ones, zeros = np.ones_like(r), np.zeros_like(r)
    # each sample's weighted features as a flat (B) and as a linear (C*running) one
    flat_x = np.column_stack([t, ones, zeros, ones]) / scale * w[:, None]
    lin_x = np.column_stack([t, zeros, r, ones]) / scale * w[:, None]

    def prefix(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        outer = np.concatenate([np.zeros((1, 4, 4)), np.cumsum(x[:, :, None] * x[:, None], 0)])
        moment = np.concatenate([np.zeros((1, 4)), np.cumsum(x * (y * w)[:, None], 0)])
        return outer, moment

    flat_gram, flat_rhs = prefix(flat_x)
    lin_gram, lin_rhs = prefix(lin_x)
    n = r.size

    def fit_splits(taus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(residuals, coefficients (a, b, c, d) per split) for every ``tau``."""
        k = np.searchsorted(r, taus, side="right")  # samples taken as flat
        gram = flat_gram[k] + lin_gram[n] - lin_gram[k] + reg * np.eye(4)
        rhs = flat_rhs[k] + lin_rhs[n] - lin_rhs[k] + reg * (theta0 * scale)
        theta = _nonneg_quadratic_min(gram, rhs) / scale
        a, b, c, d = theta.T
        # B is unidentified with no flat sample: keep it from taking over; C likewise with
        # no linear one: keep it under the flat level
        b = np.where(k == 0, np.minimum(b, c * r[0]), b)
        c = np.where(k == n, np.minimum(c, b / r[-1]), c)
        model = a[:, None] * t + np.maximum(b[:, None], c[:, None] * r) + d[:, None]
        resid = (np.maximum(model, ITL_FLOOR_S) - y) * w
        return np.einsum("sn,sn->s", resid, resid), np.column_stack([a, b, c, d])

    levels = np.unique(r)
    if levels.size > 16:
        levels_coarse = levels[np.linspace(0, levels.size - 1, 16).round().astype(np.int64)]
    else:
        levels_coarse = levels
    # 0 splits nothing off (all linear); the largest level makes every sample flat
    candidates = np.concatenate([[0.0], np.unique(levels_coarse)])
    err, coefs = fit_splits(candidates)
    i = int(np.argmin(err))
    best_err, best, best_tau = err[i], coefs[i], candidates[i]
    lo = candidates[i - 1] if i > 0 else 0.0
    hi = candidates[i + 1] if i + 1 < candidates.size else best_tau
    fine = levels[(levels > lo) & (levels < hi)]
    if fine.size:
        err, coefs = fit_splits(fine)
        j = int(np.argmin(err))
        if err[j] < best_err:
            best = coefs[j]
    a, b, c, d = (float(v) for v in best)
    return CostModel(a=a, b=b, c=c, d=d, prefill_tokens_per_s=prior.prefill_tokens_per_s)


class OnlineCostModel:
    """A cost model that follows what one kind of replica measures.

    Keeps the latest ``window`` samples; ``refit`` replaces the current model by a fit of
    them (what they cannot identify stays at the prior). Pure: the caller decides when, and
    ``fresh`` (samples since the last refit) tells it whether one is worth its cost.
    """

    def __init__(
        self,
        prior: CostModel,
        window: int = 1024,
        prior_weight: float = 1e-4,
        min_samples: int = 16,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, found {window}")
        self.prior = prior
        self.model = prior
        self.prior_weight = prior_weight
        self.min_samples = min_samples
        self._samples = np.zeros((window, 3))
        self._next = 0
        self._count = 0
        self.fresh = 0

    def observe(self, running: float, tokens: float, itl_s: float) -> None:
        """Record one measurement; idle replicas and non-positive ITLs carry no information."""
        if running <= 0 or not itl_s > 0:
            return
        self._samples[self._next] = (running, tokens, itl_s)
        self._next = (self._next + 1) % len(self._samples)
        self._count = min(self._count + 1, len(self._samples))
        self.fresh += 1

    @property
    def samples(self) -> int:
        return self._count

    def error(self) -> float:
        """RMS relative error of the current model over the window (0 with no samples)."""
        if not self._count:
            return 0.0
        s = self._samples[: self._count]
        rel = self.model.itl(s[:, 0], s[:, 1]) / s[:, 2] - 1.0
        return float(np.sqrt(np.mean(rel * rel)))

    def refit(self) -> CostModel:
        """Refit from the window (a no-op below ``min_samples``) and return the current model."""
        if self._count >= self.min_samples:
            self.fresh = 0
            s = self._samples[: self._count]
            self.model = fit_cost_model(s[:, 0], s[:, 1], s[:, 2], self.prior, self.prior_weight)
        return self.model
