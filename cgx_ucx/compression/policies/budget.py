"""Fewest bytes on the wire at no more quantization error than uniform 4 bits.

In the spirit of L-GreCo (arXiv 2210.17357): per-layer (bits, bucket) minimizing the bytes
on the wire subject to the summed quantization error being at most uniform 4-bit's; solved
exactly by dynamic programming over a discretized error budget (:func:`solve_budget`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...arrays import check_bits, check_positive_int
from ...config import NO_COMPRESSION_BITS, CompressionConfig
from ...errors import ConfigError
from ..codec import encoded_nbytes
from .assignment import Assignment, LayerInfo
from .base import Policy
from .error_model import DEFAULT_SAMPLE_VALUES, quantization_errors
from .schedule import Schedule, WindowMean

__all__ = ["BudgetPolicy", "BudgetSolution", "solve_budget"]


@dataclass(frozen=True)
class BudgetSolution:
    """Result of :func:`solve_budget`: the option per layer, its bytes and true error."""

    choice: np.ndarray
    nbytes: int
    error: float
    feasible: bool


def _default_resolution(num_layers: int) -> int:
    # The rounding of each layer's error up to a budget unit wastes < 1 unit per layer,
    # so 64 units per layer keep the waste under 1/64 (1.6%) of the budget; 16384 caps
    # the DP table (layers x units, int16) at a few MB.
    return int(min(max(1024, 64 * num_layers), 16384))


def _check_budget_inputs(errors: np.ndarray, nbytes: np.ndarray, budget: float) -> None:
    if errors.ndim != 2 or errors.shape != nbytes.shape:
        raise ConfigError(f"errors {errors.shape} and nbytes {nbytes.shape} must be equal 2-D")
    if np.isnan(errors).any() or (errors < 0).any():
        raise ConfigError("errors must be >= 0 (inf marks an unavailable option)")
    if not np.isfinite(nbytes).all() or (nbytes < 0).any():
        raise ConfigError("nbytes must be finite and >= 0")
    if not (math.isfinite(budget) and budget >= 0):
        raise ConfigError(f"budget must be finite and >= 0, got {budget!r}")


def solve_budget(
    errors: np.ndarray,
    nbytes: np.ndarray,
    budget: float,
    *,
    resolution: int | None = None,
) -> BudgetSolution:
    """Choose one option per layer minimizing total bytes with summed error <= ``budget``.

    ``errors`` and ``nbytes`` are (layers, options); an infinite error marks an option as
    unavailable. The budget is cut into ``resolution`` units of ``q = budget / resolution``
    and each option costs ``ceil(error / q)`` units; the dynamic program over "units
    used" is exact for these rounded costs. Rounding *up* is conservative: a choice whose
    rounded costs fit in ``resolution`` units has a true error ``<= sum ceil(e/q) * q <=
    budget``, so the constraint is never violated; it may only miss a solution within
    ``layers * q`` of the budget. Ties: fewer bytes, then fewer units, then the lower
    option index. With ``budget == 0`` only error-free options are allowed.
    """
    errors = np.asarray(errors, np.float64)
    nbytes = np.asarray(nbytes, np.float64)
    _check_budget_inputs(errors, nbytes, budget)
    nlayers, nopts = errors.shape
    if nlayers == 0:
        return BudgetSolution(np.zeros(0, np.int64), 0, 0.0, True)
    if nopts == 0:
        raise ConfigError("every layer needs at least one option")
    units = _default_resolution(nlayers) if resolution is None else resolution
    units = check_positive_int(units, "resolution")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if budget > 0:
            cost = np.ceil(errors / (budget / units))
        else:
            cost = np.where(errors == 0, 0.0, np.inf)
    cost[~(cost <= units)] = np.inf

    dp = np.full(units + 1, np.inf)
    dp[0] = 0.0
    choice = np.full((nlayers, units + 1), -1, np.int16 if nopts < 2**15 else np.int32)
    for layer in range(nlayers):
        new = np.full(units + 1, np.inf)
        arg = choice[layer]
        for opt in _undominated(cost[layer], nbytes[layer]):
            c = int(cost[layer, opt])
            cand = dp[: units + 1 - c] + nbytes[layer, opt]
            seg = new[c:]
            better = cand < seg
            seg[better] = cand[better]
            arg[c:][better] = opt
        dp = new
    j = int(np.argmin(dp))
    if not np.isfinite(dp[j]):
        return BudgetSolution(np.full(nlayers, -1, np.int64), -1, float("inf"), False)
    picked = np.empty(nlayers, np.int64)
    for layer in range(nlayers - 1, -1, -1):
        opt = int(choice[layer, j])
        picked[layer] = opt
        j -= int(cost[layer, opt])
    rows = np.arange(nlayers)
    return BudgetSolution(
        picked,
        int(nbytes[rows, picked].sum()),
        float(errors[rows, picked].sum()),
        True,
    )


def _undominated(cost: np.ndarray, nbytes: np.ndarray) -> list[int]:
    """Options not dominated in (rounded cost, bytes); equal pairs keep the lowest index."""
    keep = []
    avail = [o for o in range(cost.shape[0]) if np.isfinite(cost[o])]
    for o in avail:
        dominated = False
        for p in avail:
            if p == o:
                continue
            le = cost[p] <= cost[o] and nbytes[p] <= nbytes[o]
            strict = cost[p] < cost[o] or nbytes[p] < nbytes[o]
            if le and (strict or p < o):
                dominated = True
                break
        if not dominated:
            keep.append(o)
    return keep


class BudgetPolicy(Policy):
    """Fewest bytes on the wire at no more quantization error than uniform ``config``.

    1. Statistics: per compressible layer, its squared quantization error at every
       (bucket size, bits) candidate, measured (:func:`quantization_errors`) on each of the
       ``window`` steps before a decision and averaged.
    2. Options per layer: every ``bits x bucket_sizes`` pair, plus uncompressed (no error,
       4 bytes a value) when ``allow_uncompressed``; bytes from
       :func:`~cgx_ucx.compression.codec.encoded_nbytes`.
    3. Budget: ``budget_scale`` times the error of uniform ``config`` (4 bits, buckets of
       1024) summed over the compressible layers with finite statistics.
    4. :func:`solve_budget`. If its bytes are not below uniform's (the conservative
       rounding can cost the last units of budget), uniform ``config`` is kept, so with
       ``budget_scale >= 1`` it never sends more than static nor errs more than static.
    Layers without finite statistics (no observation, or an overflowed gradient) keep their
    assignment and spend none of the budget.
    """

    name = "budget"

    def __init__(
        self,
        layers: Sequence[LayerInfo | int],
        config: CompressionConfig | None = None,
        *,
        bits: Sequence[int] = (2, 3, 4, 5, 6, 8),
        bucket_sizes: Sequence[int] = (128, 256, 512, 1024),
        allow_uncompressed: bool = True,
        budget_scale: float = 1.0,
        resolution: int | None = None,
        sample_values: int = DEFAULT_SAMPLE_VALUES,
        schedule: Schedule | None = None,
        **kwargs: Any,
    ) -> None:
        self.option_bits = tuple(sorted({check_bits(b) for b in bits} - {NO_COMPRESSION_BITS}))
        self.option_buckets = tuple(
            sorted({check_positive_int(b, "bucket size") for b in bucket_sizes})
        )
        if not self.option_bits or not self.option_buckets:
            raise ConfigError("budget policy needs at least one bit width and bucket size")
        if not (math.isfinite(budget_scale) and budget_scale > 0):
            raise ConfigError(f"budget_scale must be > 0, got {budget_scale!r}")
        self.allow_uncompressed = bool(allow_uncompressed)
        self.budget_scale = float(budget_scale)
        self.resolution = resolution
        self.sample_values = check_positive_int(sample_values, "sample_values")
        #: the last decision's summed error and its budget (visibility)
        self.last_error = float("nan")
        self.last_budget = float("nan")
        super().__init__(
            layers,
            config,
            schedule=schedule or Schedule(warmup=50, interval=500, window=10),
            **kwargs,
        )
        cfg = self.config
        self._stat_bits = tuple(sorted({*self.option_bits, cfg.bits} - {NO_COMPRESSION_BITS}))
        self._stat_buckets = tuple(sorted({*self.option_buckets, cfg.bucket_size}))
        if math.lcm(*self._stat_buckets) > 1 << 20:
            raise ConfigError(
                f"bucket sizes {self._stat_buckets} have a least common multiple above 2**20: "
                "choose sizes that divide each other (e.g. powers of two)"
            )
        self._errors = WindowMean(self.num_layers, (len(self._stat_buckets), len(self._stat_bits)))

    def options(self) -> list[tuple[int, int]]:
        """The (bits, bucket size) candidates, uncompressed last."""
        opts = [(b, s) for b in self.option_bits for s in self.option_buckets]
        if self.allow_uncompressed:
            opts.append((NO_COMPRESSION_BITS, self.config.bucket_size))
        return opts

    def _observe_layer(self, step: int, index: int, grad: Any) -> None:
        errs = quantization_errors(
            grad, self._stat_bits, self._stat_buckets, sample_values=self.sample_values
        )
        self._errors.add(index, errs)

    def _statistics(self) -> np.ndarray:
        return self._errors.mean()

    def _statistics_size(self) -> int:
        return self._errors.sum.size

    def _after_decision(self) -> None:
        self._errors.reset()

    def _error_of(self, errors: np.ndarray, bits: int, bucket: int) -> np.ndarray:
        if bits == NO_COMPRESSION_BITS:
            return np.zeros(errors.shape[0])
        return errors[:, self._stat_buckets.index(bucket), self._stat_bits.index(bits)]

    def _decide(self, step: int, statistics: np.ndarray) -> Assignment:
        errors = statistics.reshape(self._errors.shape)
        bits = list(self._current.bits)
        buckets = list(self._current.bucket_sizes)
        layers = [
            i
            for i in range(self.num_layers)
            if self._compressible[i] and np.isfinite(errors[i]).all() and (errors[i] >= 0).all()
        ]
        if not layers:
            return Assignment(tuple(bits), tuple(buckets), step)
        errors = errors[layers]
        cfg = self.config
        ref_err = float(self._error_of(errors, cfg.bits, cfg.bucket_size).sum())
        budget = self.budget_scale * ref_err
        sizes = [int(self._sizes[i]) for i in layers]
        ref_bytes = sum(encoded_nbytes(n, cfg.bits, cfg.bucket_size) for n in sizes)
        opts = self.options()
        table = np.stack([self._error_of(errors, b, s) for b, s in opts], axis=1)
        nbytes = np.array([[encoded_nbytes(n, b, s) for b, s in opts] for n in sizes], np.float64)
        sol = solve_budget(table, nbytes, budget, resolution=self.resolution)
        if sol.feasible and (sol.nbytes < ref_bytes or self.budget_scale < 1.0):
            for r, i in enumerate(layers):
                bits[i], buckets[i] = opts[int(sol.choice[r])]
            self.last_error = sol.error
        else:
            for i in layers:
                bits[i], buckets[i] = cfg.bits, cfg.bucket_size
            self.last_error = ref_err
        self.last_budget = budget
        return Assignment(tuple(bits), tuple(buckets), step)

    def _extra_state(self) -> dict[str, Any]:
        return {
            **self._errors.state("errors"),
            "last_error": self.last_error,
            "last_budget": self.last_budget,
        }

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        errors = WindowMean(self.num_layers, self._errors.shape[1:])
        errors.load("errors", state)
        self._errors = errors
        self.last_error = float(state["last_error"])
        self.last_budget = float(state["last_budget"])
