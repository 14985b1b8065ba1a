"""Policies by name: the ``POLICIES`` registry and :func:`make_policy`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...config import CompressionConfig
from ...errors import ConfigError
from .assignment import LayerInfo
from .auto import AutoPolicy
from .base import Policy
from .budget import BudgetPolicy
from .kmeans import KMeansPolicy
from .static import StaticPolicy

__all__ = ["POLICIES", "make_policy"]

POLICIES: dict[str, type[Policy]] = {
    "static": StaticPolicy,
    "kmeans": KMeansPolicy,
    "budget": BudgetPolicy,
    "auto": AutoPolicy,
}


def make_policy(
    name: str,
    layers: Sequence[LayerInfo | int],
    config: CompressionConfig | None = None,
    **kwargs: Any,
) -> Policy:
    """Build a policy by name: ``"static" | "kmeans" | "budget" | "auto"``."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown compression policy {name!r}; choose one of {sorted(POLICIES)}")
    return cls(layers, config, **kwargs)
