"""The CGX paper's default policy: one width everywhere it is allowed, never re-decided."""

from __future__ import annotations

import numpy as np

from .assignment import Assignment
from .base import Policy

__all__ = ["StaticPolicy"]


class StaticPolicy(Policy):
    """The CGX paper's default: ``config`` (4 bits, buckets of 1024) on every compressible
    layer; 1-D layers and layers under ``layer_min_size`` uncompressed. Never re-decides.
    """

    name = "static"

    def due(self, step: int) -> bool:
        return False

    def observing(self, step: int) -> bool:
        # only to fill the stats table on logging steps
        return self._log_step(step) and bool(self._compressible.any())

    def _decide(self, step: int, statistics: np.ndarray) -> Assignment:
        return self.static_assignment(step)
