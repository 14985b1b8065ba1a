"""The GPU gate shared by the GPU tests: skip without a usable GPU, fail instead when
``CGX_UCX_REQUIRE_GPU=1`` (``benchmarks/gpu_check.sh`` sets it, so a GPU machine that
silently skipped would not pass as checked).

``conftest.py`` applies it to every test marked ``gpu`` (the ``cupy`` case of the ``xp``
fixture included) and serves it as the ``cp`` fixture; tests that need CuPy outside a
fixture call :func:`usable_cupy`.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest


@functools.cache
def _probe() -> tuple[Any, str]:
    """(cupy, "") once a small kernel has run on a device, else (None, why). Probed once."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
        float((cupy.arange(4, dtype=cupy.float32) * 2).sum())
    except Exception as exc:  # ImportError, CUDARuntimeError, driver problems
        return None, repr(exc)
    return cupy, ""


def usable_cupy() -> Any:
    """CuPy, once a small kernel has run on a device; else skip (or fail, see above)."""
    cupy, why = _probe()
    if cupy is None:
        if os.environ.get("CGX_UCX_REQUIRE_GPU") == "1":
            pytest.fail(f"CGX_UCX_REQUIRE_GPU=1 but no usable GPU: {why}", pytrace=False)
        pytest.skip(f"no usable GPU: {why}")
    return cupy
