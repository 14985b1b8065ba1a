"""When a policy decides, and the per-layer window means it decides from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...arrays import check_positive_int

__all__ = ["Schedule", "WindowMean"]


@dataclass(frozen=True)
class Schedule:
    """When a policy decides, and on which steps it gathers statistics for that decision.

    Decisions at ``warmup, warmup + interval, warmup + 2 * interval, ...``; statistics are
    gathered on the ``window`` steps before each decision (and only there, so most steps
    cost nothing). A pure function of the step, identical on every rank.
    """

    warmup: int = 50
    interval: int = 500
    window: int = 20

    def __post_init__(self) -> None:
        check_positive_int(self.warmup, "warmup", 0)
        check_positive_int(self.interval, "interval", 1)
        check_positive_int(self.window, "window", 0)

    def is_decision(self, step: int) -> bool:
        return step >= self.warmup and (step - self.warmup) % self.interval == 0

    def next_decision(self, step: int) -> int:
        """The first decision step strictly after ``step``."""
        if step < self.warmup:
            return self.warmup
        return self.warmup + ((step - self.warmup) // self.interval + 1) * self.interval

    def in_window(self, step: int) -> bool:
        return step >= 0 and self.next_decision(step) - self.window <= step


class WindowMean:
    """Per-layer running sums of statistics over a window; mean is NaN where unobserved."""

    def __init__(self, num_layers: int, shape: tuple[int, ...]) -> None:
        self.sum = np.zeros((num_layers, *shape))
        self.count = np.zeros(num_layers, np.int64)

    @property
    def shape(self) -> tuple[int, ...]:
        """``(layers, *statistic shape)``."""
        return tuple(self.sum.shape)

    def add(self, index: int, values: np.ndarray) -> None:
        self.sum[index] += values
        self.count[index] += 1

    def mean(self) -> np.ndarray:
        cnt = np.where(self.count > 0, self.count, np.nan).astype(np.float64)
        return self.sum / cnt.reshape(-1, *([1] * (self.sum.ndim - 1)))

    def reset(self) -> None:
        self.sum[:] = 0.0
        self.count[:] = 0

    def state(self, prefix: str) -> dict[str, Any]:
        return {f"{prefix}_sum": self.sum.copy(), f"{prefix}_count": self.count.copy()}

    def load(self, prefix: str, state: Mapping[str, Any]) -> None:
        self.sum = np.array(state[f"{prefix}_sum"], np.float64).reshape(self.sum.shape)
        self.count = np.array(state[f"{prefix}_count"], np.int64).reshape(self.count.shape)
