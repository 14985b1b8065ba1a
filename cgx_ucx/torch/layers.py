"""Layers of a flat gradient buffer: which are compressed, what they cost on the wire.

Shared by the DDP hook (:func:`~cgx_ucx.torch.hook.cgx_hook`) and
:class:`~cgx_ucx.torch.grad_sync.GradientSync`, so that both send a model the same way:

1. One layer per gradient tensor, back to back in the buffer (DDP's bucket order, or
   GradientSync's).
2. The paper's rule (CGX, section 4) decides which layers are quantized: floating
   point (the codec's dtypes), more than one dimension, and at least
   ``max(layer_min_size, config.minimal_size)`` values. 1-D tensors (biases, norms) and
   small layers are a small share of the bytes and the most sensitive to error, so they
   go exact. The adaptive policies apply the same rule to their candidates.
3. The bytes a rank sends for one buffer come from the codec's own segment length
   (:func:`cgx_ucx.compression.encoded_nbytes`), the one formula of the wire size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from ..compression import HEADER_NBYTES, encoded_nbytes
from ..config import CompressionConfig
from ..layout import LayerSpec, Layout
from ._convert import is_float

__all__ = [
    "PAPER_DEFAULTS",
    "average_first",
    "bucket_op",
    "bucket_seed",
    "compressible",
    "layer_layout",
    "layer_wire_bytes",
    "wire_bytes",
]

#: The paper's defaults (CGX, section 5): 4 bits, buckets of 1024 values.
PAPER_DEFAULTS = CompressionConfig(bits=4, bucket_size=1024)

#: Stochastic-rounding seeds of one step are spread over this many bucket indices.
_SEED_STEP_SHIFT = 20


def compressible(tensor: torch.Tensor, config: CompressionConfig, layer_min_size: int) -> bool:
    """True when the layer ``tensor`` is quantized under ``config`` (the paper's rule)."""
    threshold = max(layer_min_size, config.minimal_size)
    return config.enabled and is_float(tensor) and tensor.dim() > 1 and tensor.numel() >= threshold


def layer_layout(
    tensors: Sequence[torch.Tensor], config: CompressionConfig, layer_min_size: int
) -> Layout:
    """Layout of a flat buffer holding ``tensors`` back to back.

    A tensor is compressed when compression is on, it is floating point, it has more
    than one dimension and at least ``max(layer_min_size, config.minimal_size)`` values
    (:func:`compressible`). A bucket seen again (every step: the same sizes and rule
    answers) gets the layout built the first time.
    """
    sizes = tuple(t.numel() for t in tensors)
    return _layout(config, sizes, tuple(compressible(t, config, layer_min_size) for t in tensors))


@functools.lru_cache(maxsize=256)  # a model's buckets under a few configurations
def _layout(config: CompressionConfig, sizes: tuple[int, ...], flags: tuple[bool, ...]) -> Layout:
    return Layout.from_sizes(list(sizes), config, compressible=list(flags))


def layer_wire_bytes(spec: LayerSpec, itemsize: int) -> int:
    """Payload bytes of one copy of the layer ``spec``, frame and codec headers left out.

    Compressed: the codec's segment (8 bytes of meta per bucket plus
    ``ceil(n * bits / 8)`` code bytes, DESIGN.md wire format) without its header.
    Uncompressed layers travel as their raw values, of any dtype: ``n * itemsize``.
    """
    if not spec.compressed:
        return spec.numel * itemsize
    return encoded_nbytes(spec.numel, spec.bits, spec.bucket_size) - HEADER_NBYTES


def wire_bytes(layout: Layout, itemsize: int, world_size: int) -> int:
    """Payload bytes one rank sends in a scatter-reduce-allgather of ``layout``.

    Each rank sends (world-1)/world of the buffer in each of the two phases, each layer
    costing :func:`layer_wire_bytes`. Headers are left out (they are constant per
    message, not per value).
    """
    total = sum(layer_wire_bytes(spec, itemsize) for spec in layout)
    return 2 * total * (world_size - 1) // max(world_size, 1)


def bucket_op(layout: Layout, error_feedback: bool) -> str:
    """How a gradient bucket of ``layout`` is averaged: ``"avg"``, by the engine, or
    ``"sum"`` after the caller divided the bucket by the world size.

    A compressed layout sums in float32 and the engine divides each reduced piece as it
    requantizes it: no pass over the bucket of its own. An uncompressed one is divided
    first, as PyTorch's allreduce_hook (fp16 sums do not overflow, and the result is
    gloo's bit for bit); so is a bucket with error feedback, whose residuals are kept,
    and checkpointed, on the averaged values."""
    return "avg" if layout.compressed and not error_feedback else "sum"


def average_first(buf: torch.Tensor, layout: Layout, error_feedback: bool, world_size: int) -> str:
    """The op to send gradient bucket ``buf`` with (:func:`bucket_op`); where that is
    ``"sum"``, ``buf`` is divided by ``world_size`` here, in place, first."""
    op = bucket_op(layout, error_feedback)
    if op == "sum":
        buf.div_(world_size)
    return op


def bucket_seed(config: CompressionConfig, step: int, index: int) -> int:
    """The stochastic-rounding seed of bucket ``index`` at ``step``: a different one for
    every step and bucket (the codec's contract), the same on every rank."""
    return (config.seed + (step << _SEED_STEP_SHIFT) + index) % (1 << 64)
