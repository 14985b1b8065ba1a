"""The GPU gate shared by the GPU tests: skip without a usable GPU, fail instead when
``CGX_UCX_REQUIRE_GPU=1`` (``benchmarks/gpu_check.sh`` sets it, so a GPU machine that
silently skipped would not pass as checked)."""

from __future__ import annotations

import os
from typing import Any

import pytest


def usable_cupy() -> Any:
    """CuPy, once a small kernel has run on a device; else skip (or fail, see above)."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
        float((cupy.arange(4, dtype=cupy.float32) * 2).sum())
    except Exception as exc:  # ImportError, CUDARuntimeError, driver problems
        if os.environ.get("CGX_UCX_REQUIRE_GPU") == "1":
            pytest.fail(f"CGX_UCX_REQUIRE_GPU=1 but no usable GPU: {exc!r}")
        pytest.skip(f"no usable GPU: {exc!r}")
    return cupy
