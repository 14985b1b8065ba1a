"""Layer-wise adaptive compression: which layers to quantize, and with how many bits.

A *policy* turns per-layer statistics into a per-layer :class:`Assignment` (bits, bucket
size; ``bits == 32`` sends the layer uncompressed) and from it the
:class:`~cgx_ucx.layout.Layout` that travels with every allreduce. Re-exports only; one
concept per module:

``assignment``   LayerInfo, Assignment, the paper's defaults
``error_model``  the measured quantization error of a layer (:func:`quantization_errors`)
``schedule``     when a policy decides, and the window means it decides from
``base``         the Policy protocol (observe, statistics, decide, adopt, state)
``static``       the CGX paper's default: 4 bits, buckets of 1024, 1-D and layers with
                 fewer than ``layer_min_size`` (1024, torch_cgx's ``CGXState``) values
                 uncompressed
``kmeans``       CGX's adjuster (torch_cgx's ``KMeanAdjuster``): k-means on (log size,
                 log score) into one cluster per bit width, more bits for higher scores
``budget``       L-GreCo-like (arXiv 2210.17357): fewest bytes at no more summed
                 quantization error than uniform 4 bits, by dynamic programming
``cost``         the allreduce cost model: wire time plus codec time per layer
``auto``         compress a layer only where the cost model says it saves time, given the
                 measured link bandwidth and codec throughput; re-probe on drift
``registry``     ``POLICIES`` and :func:`make_policy`

Policies only compute. Agreeing on a decision across ranks and probing the link run
collectives, so they live a layer up, in :mod:`cgx_ucx.agreement`.
"""

from .assignment import (
    PAPER_CONFIG,
    PAPER_LAYER_MIN_SIZE,
    Assignment,
    LayerInfo,
    layers_from_parameters,
    wire_nbytes,
)
from .auto import AutoPolicy
from .base import LayerStats, Policy, ProbeValue, probe_vector
from .budget import BudgetPolicy, BudgetSolution, solve_budget
from .cost import CodecCost, allreduce_seconds, layer_seconds, probe_codec
from .error_model import DEFAULT_SAMPLE_VALUES, quantization_errors
from .kmeans import KMeansPolicy, deterministic_kmeans
from .registry import POLICIES, make_policy
from .schedule import Schedule
from .static import StaticPolicy

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
    "probe_vector",
    "quantization_errors",
    "solve_budget",
    "wire_nbytes",
]
