"""Deprecated: the adaptive policies moved to :mod:`cgx_ucx.compression.policies`.

This module only re-exports the policy names from there, one concept per module:
``assignment`` (LayerInfo, Assignment, layers_from_parameters), ``error_model``
(quantization_errors), ``schedule`` (Schedule), ``base`` (Policy, LayerStats), ``static``,
``kmeans``, ``budget`` (solve_budget), ``cost`` (CodecCost, allreduce_seconds,
layer_seconds, probe_codec), ``auto`` (AutoPolicy) and ``registry`` (POLICIES,
make_policy). ``wire_nbytes`` is an alias of
:func:`cgx_ucx.compression.codec.encoded_nbytes`.

``agree``, ``agree_sync`` and ``make_link_probe`` run collectives, which a compression
module must not do: import them from :mod:`cgx_ucx.agreement`.
"""

from __future__ import annotations

import warnings

from .policies import (
    DEFAULT_SAMPLE_VALUES,
    PAPER_CONFIG,
    PAPER_LAYER_MIN_SIZE,
    POLICIES,
    Assignment,
    AutoPolicy,
    BudgetPolicy,
    BudgetSolution,
    CodecCost,
    KMeansPolicy,
    LayerInfo,
    LayerStats,
    Policy,
    ProbeValue,
    Schedule,
    StaticPolicy,
    allreduce_seconds,
    deterministic_kmeans,
    layer_seconds,
    layers_from_parameters,
    make_policy,
    probe_codec,
    quantization_errors,
    solve_budget,
    wire_nbytes,
)

__all__ = [
    "DEFAULT_SAMPLE_VALUES",
    "PAPER_CONFIG",
    "PAPER_LAYER_MIN_SIZE",
    "POLICIES",
    "Assignment",
    "AutoPolicy",
    "BudgetPolicy",
    "BudgetSolution",
    "CodecCost",
    "KMeansPolicy",
    "LayerInfo",
    "LayerStats",
    "Policy",
    "ProbeValue",
    "Schedule",
    "StaticPolicy",
    "allreduce_seconds",
    "deterministic_kmeans",
    "layer_seconds",
    "layers_from_parameters",
    "make_policy",
    "probe_codec",
    "quantization_errors",
    "solve_budget",
    "wire_nbytes",
]

warnings.warn(
    "cgx_ucx.compression.adaptive is deprecated: import the policies from "
    "cgx_ucx.compression.policies and agree/agree_sync/make_link_probe from "
    "cgx_ucx.agreement",
    DeprecationWarning,
    stacklevel=2,
)
