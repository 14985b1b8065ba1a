"""Fixtures and hooks shared by the test modules.

- The GPU gate (``_gpu.usable_cupy``): a test marked ``gpu`` is skipped without a usable
  GPU and FAILS instead when ``CGX_UCX_REQUIRE_GPU=1``.
- ``cp``: CuPy behind that gate.
- ``xp``: one test body run with ``xp=numpy`` and ``xp=cupy`` (the cupy case carries the
  ``gpu`` mark, so it is gated, and ``-m gpu`` selects it), as CuPy's own tests do.

The multi-process runners are plain modules next to this one: ``harness`` (engine jobs)
and ``torch_helpers`` (torch jobs on the same runner).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from _gpu import usable_cupy


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None:
        usable_cupy()


@pytest.fixture
def cp() -> ModuleType:
    """CuPy with a working device, else skip (or fail when CGX_UCX_REQUIRE_GPU=1)."""
    return usable_cupy()


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request: pytest.FixtureRequest) -> ModuleType:
    """The array module of the test's buffers: NumPy (host) or CuPy (GPU, gated)."""
    return usable_cupy() if request.param == "cupy" else np
