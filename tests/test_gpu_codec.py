"""The GPU codec against the CPU: identical bytes for round-to-nearest and stochastic.

Skipped without a usable CUDA GPU; with ``CGX_UCX_REQUIRE_GPU=1`` a missing GPU is a
failure (``benchmarks/gpu_check.sh`` sets it).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from _gpu import usable_cupy

from cgx_ucx.compression import (
    ErrorFeedback,
    backend_name,
    decode,
    decode_add,
    encode,
    encoded_nbytes,
    read_header,
    reference,
)
from cgx_ucx.errors import CodecError

pytestmark = pytest.mark.gpu
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]


@pytest.fixture(scope="module")
def cp() -> Any:
    """CuPy with a working device, else skip (or fail when CGX_UCX_REQUIRE_GPU=1)."""
    return usable_cupy()


def values(n: int, dtype: np.dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3)).astype(dtype)
    if n > 100:
        x[rng.integers(0, n, 5)] = 0.0
        x[n // 3 : n // 3 + 64] = x[n // 3]
    return x


def host(a: Any) -> np.ndarray:
    return a.get()


SIZES_BUCKETS = [
    (0, 1024),
    (1, 1024),
    (7, 3),
    (1000, 1),
    (4099, 1000),
    (100_003, 512),
    (100_003, 1024),
    (65_536 + 5, 100),
    (300_000, 65_536),
    ((1 << 20) + 3, 1024),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,bucket", SIZES_BUCKETS)
def test_gpu_bytes_equal_cpu_bytes(cp: Any, n: int, bucket: int) -> None:
    for dtype in DTYPES:
        x = values(n, dtype, seed=n + bucket)
        xd = cp.asarray(x)
        assert backend_name(xd) == "cupy"
        for bits in range(1, 9):
            for stochastic in (False, True):
                gpu = encode(xd, bits, bucket, stochastic=stochastic, seed=bits)
                cpu = encode(x, bits, bucket, stochastic=stochastic, seed=bits)  # Numba
                assert np.array_equal(host(gpu), cpu), (dtype, bits, stochastic)
            for out_dtype in (np.float32, dtype):
                y = decode(gpu, out=cp.empty(n, out_dtype))
                assert np.array_equal(
                    host(y).view(np.uint8), decode(cpu, out=np.empty(n, out_dtype)).view(np.uint8)
                )
            acc = cp.linspace(-1, 1, n, dtype=cp.float32)
            acc_cpu = host(acc)
            decode_add(gpu, acc)
            decode_add(cpu, acc_cpu)
            assert np.array_equal(host(acc).view(np.uint32), acc_cpu.view(np.uint32))


@pytest.mark.timeout(120)
def test_small_cases_equal_reference(cp: Any) -> None:
    for n, bits, bucket in [(13, 3, 4), (600, 7, 7), (2500, 6, 2048), (9000, 8, 512)]:
        for dtype in DTYPES:
            x = values(n, dtype, seed=bits)
            x[n // 2] = np.nan
            ref = reference.encode(x, bits, bucket, stochastic=True, seed=5)
            got = encode(cp.asarray(x), bits, bucket, stochastic=True, seed=5)
            assert np.array_equal(host(got), ref)
            assert np.array_equal(
                host(decode(got, out=cp.empty(n, np.float64))),
                reference.decode(ref, out=np.empty(n, np.float64)),
                equal_nan=True,
            )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("offset", [1, 2, 3, 5])
def test_unaligned_segments(cp: Any, offset: int) -> None:
    # segments packed back to back in one message start at any byte
    for bits in (4, 32):
        for dtype in DTYPES:
            x = values(3001, dtype, seed=offset)
            need = encoded_nbytes(3001, bits, 256, dtype)
            big = cp.zeros(need + 16, cp.uint8)
            seg = encode(cp.asarray(x), bits, 256, out=big[offset:])
            assert seg.data.ptr == big.data.ptr + offset and seg.size == need
            assert np.array_equal(host(seg), encode(x, bits, 256))
            for out_dtype in (np.float32, np.float16, BF16, np.float64):
                y = decode(seg, out=cp.empty(3001, out_dtype))
                want = decode(host(seg), out=np.empty(3001, out_dtype))
                assert np.array_equal(host(y).view(np.uint8), want.view(np.uint8))
            acc = cp.ones(3001, cp.float32)
            decode_add(seg, acc)
            assert np.array_equal(
                host(acc), np.float32(1) + decode(host(seg), out=np.empty(3001, np.float32))
            )


@pytest.mark.timeout(60)
def test_nonfinite_buckets_and_constants(cp: Any) -> None:
    x = np.repeat(np.float32([1.5, -2.0, 0.0, 7.0]), 64)
    x[70] = np.inf
    y = host(decode(encode(cp.asarray(x), 4, 64)))
    assert np.array_equal(np.isfinite(y), np.arange(256) // 64 != 1)
    assert np.array_equal(y[np.isfinite(y)], x[np.isfinite(y)])


@pytest.mark.timeout(60)
def test_non_default_stream_and_validation(cp: Any) -> None:
    x = values(50_000, np.dtype(np.float32), seed=1)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        xd = cp.asarray(x)
        buf = encode(xd, 4, 512)
        acc = cp.zeros(50_000, cp.float32)
        decode_add(buf, acc)
    stream.synchronize()
    assert np.array_equal(host(acc), decode(encode(x, 4, 512)))
    with pytest.raises(CodecError):
        decode(buf[:-1])
    with pytest.raises(CodecError):
        decode_add(buf, np.zeros(50_000, np.float32))  # host acc, device buffer
    with pytest.raises(CodecError):
        encode(xd, 4, 512, out=np.empty(encoded_nbytes(50_000, 4, 512), np.uint8))
    assert read_header(buf).numel == 50_000


@pytest.mark.timeout(60)
def test_error_feedback_on_gpu(cp: Any) -> None:
    ef_gpu, ef_cpu = ErrorFeedback(), ErrorFeedback()
    rng = np.random.default_rng(0)
    for step in range(3):
        x = rng.standard_normal(10_000).astype(np.float32)
        a = ef_gpu.encode("w", cp.asarray(x), 2, 256, seed=step)
        b = ef_cpu.encode("w", x, 2, 256, seed=step)
        assert np.array_equal(host(a), b)
    assert np.array_equal(ef_gpu.state_dict()["w"], ef_cpu.state_dict()["w"])


@pytest.mark.timeout(60)
def test_subnormals_are_not_flushed(cp: Any) -> None:
    # CuPy's RawModule would compile with -ftz=true; the backend must not flush subnormals
    rng = np.random.default_rng(3)
    f32 = (rng.standard_normal(5000) * 1e-39).astype(np.float32)  # float32 subnormals
    f16 = (rng.standard_normal(5000) * 1e-6).astype(np.float16)  # float16 subnormals
    for x in (f32, f16):
        for bits in (2, 8, 32):
            for stochastic in (False, True):
                got = encode(cp.asarray(x), bits, 128, stochastic=stochastic, seed=1)
                want = reference.encode(x, bits, 128, stochastic=stochastic, seed=1)
                assert np.array_equal(host(got), want)
            y = decode(cp.asarray(want), out=cp.empty(5000, cp.float32))
            assert np.array_equal(host(y), reference.decode(want, out=np.empty(5000, np.float32)))
