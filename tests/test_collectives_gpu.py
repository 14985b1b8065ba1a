"""CuPy buffers between two processes on one GPU (UCX moves device memory directly:
cuda_ipc / cuda_copy, no host copy). Marked ``gpu``: skipped without a usable GPU; with
``CGX_UCX_REQUIRE_GPU=1`` a missing GPU is a failure (the gate is in ``conftest.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from harness import run_ranks

pytestmark = pytest.mark.gpu


def data(rank: int, n: int) -> np.ndarray:
    return np.random.default_rng(rank).integers(-50, 50, n).astype(np.float32)


async def gpu_collectives(ctx, n):
    import cupy
    import ucxx

    from cgx_ucx.collectives import connect
    from cgx_ucx.config import CommConfig

    async with await connect(
        ctx.store, ctx.rank, ctx.world_size, config=CommConfig(timeout=60)
    ) as comm:
        x = cupy.asarray(data(ctx.rank, n))
        await comm.allreduce(x)
        y = cupy.asarray(data(ctx.rank, n))
        await comm.allreduce(y, bits=4, bucket_size=512)
        b = cupy.arange(n, dtype=cupy.float32) if ctx.rank == 0 else cupy.zeros(n, cupy.float32)
        await comm.broadcast(b)
        g = await comm.allgather(cupy.full(3, ctx.rank, cupy.int32))
        transports = sorted(ucxx.get_active_transports())
        return x.get(), y.get(), b.get(), g.get(), type(g).__module__, transports


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [1, 3_000_017])
def test_cupy_buffers_between_two_processes(n):
    results = run_ranks(gpu_collectives, 2, args=(n,), timeout=170)
    exact = data(0, n) + data(1, n)
    for x, y, b, g, mod, transports in results:
        np.testing.assert_array_equal(x, exact)
        assert y.tobytes() == results[0][1].tobytes()
        assert np.abs(y - exact).max() <= 3 * 200 / 15
        np.testing.assert_array_equal(b, np.arange(n, dtype=np.float32))
        np.testing.assert_array_equal(g, [[0, 0, 0], [1, 1, 1]])
        assert mod.startswith("cupy")
        assert "cuda_ipc" in transports or "cuda_copy" in transports, transports
