"""Zero-copy views of torch tensors as the arrays the engine moves.

The engine works on NumPy (host) and CuPy (device) arrays; a tensor is handed over as
a view of its own storage, never a copy, so the collective writes its result straight
into the tensor (DESIGN.md: "tensors through DLPack / __cuda_array_interface__").

- CPU: ``tensor.numpy()``; bfloat16, which NumPy lacks, as an int16 view re-typed to
  ``ml_dtypes.bfloat16`` (same bytes).
- CUDA: ``cupy.from_dlpack``; CuPy is imported only when a CUDA tensor is seen. The
  current stream is synchronized first (the engine works on its own stream).

The view itself is :func:`cgx_ucx.arrays.torch_as_array`; this module adds what the
torch layer checks first (dense, contiguous, a device and dtype the engine moves).
"""

from __future__ import annotations

from typing import Any

import torch

from ..arrays import torch_as_array
from ..errors import ConfigError

__all__ = [
    "FLOAT_DTYPES",
    "as_array",
    "can_sum_dtype",
    "is_float",
]

#: Dtypes the codec quantizes.
FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})

#: Dtypes the engine sums itself. Those outside FLOAT_DTYPES go uncompressed (exact
#: for integers); complex tensors are summed as their (real, imag) float pairs.
_SUMMABLE = FLOAT_DTYPES | {
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
}

#: CPU dtypes whose ``numpy()`` view is the array the engine moves, as it is.
_PLAIN_CPU = frozenset(_SUMMABLE - {torch.bfloat16, torch.complex64, torch.complex128})


def is_float(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s dtype can be quantized."""
    return tensor.dtype in FLOAT_DTYPES


def can_sum_dtype(dtype: torch.dtype) -> bool:
    """True when the engine can sum tensors of ``dtype`` itself (else the backend
    reduces locally)."""
    return dtype in _SUMMABLE


def as_array(tensor: torch.Tensor) -> Any:
    """A NumPy or CuPy array sharing ``tensor``'s memory (no copy).

    ``tensor`` must be dense and contiguous; callers make a contiguous staging copy
    first when it is not (and copy the result back).
    """
    if tensor.layout is not torch.strided:
        raise ConfigError(f"cgx_ucx moves dense tensors only, got layout {tensor.layout}")
    if tensor.is_cpu and tensor.dtype in _PLAIN_CPU and tensor.is_contiguous():
        # The common case, in fewest steps (every small all_reduce pays them):
        # a contiguous host tensor of a NumPy dtype is its own array view.
        return (tensor.detach() if tensor.requires_grad else tensor).numpy()
    if not tensor.is_contiguous():
        raise ConfigError("as_array needs a contiguous tensor (make a staging copy first)")
    t = tensor.detach()
    if t.dtype.is_complex:
        # Complex values are moved as their float pairs (broadcast/allgather only).
        t = torch.view_as_real(t)
    if t.device.type == "cpu":
        if t.dtype in _PLAIN_CPU:
            return t.numpy()  # the common case, without torch_as_array's checks
        try:
            return torch_as_array(t)  # bfloat16: the same bytes as ml_dtypes.bfloat16
        except TypeError as exc:
            raise ConfigError(f"dtype {t.dtype} has no NumPy equivalent") from exc
    if t.device.type == "cuda":
        try:
            import cupy  # noqa: F401 (torch_as_array imports it; a missing one is named here)
        except ImportError as exc:
            raise ConfigError("CUDA tensors need CuPy: pip install 'cgx_ucx[gpu]'") from exc
        if t.dtype == torch.bfloat16:
            # CuPy has no bfloat16 dtype, and the GPU codec takes float32/float16 only.
            raise ConfigError("bfloat16 CUDA tensors are not supported yet; use float16/float32")
        # The engine reads and writes the memory from its own thread and stream: the
        # kernels that produced it on torch's current stream must be done first.
        torch.cuda.current_stream(t.device).synchronize()
        return torch_as_array(t)
    raise ConfigError(f"cgx_ucx supports CPU and CUDA tensors, got device {t.device}")
