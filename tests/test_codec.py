"""The quantization codec: error bounds, exact cases, wire format, Numba vs NumPy, and the
GPU (CuPy) codec against the host's.

Tests taking the ``xp`` fixture run one body on NumPy buffers (the Numba codec) and on CuPy
buffers (the GPU codec); tests marked ``gpu`` are GPU-only (bytes equal to the CPU's over a
sweep of sizes, streams). Both GPU kinds are skipped without a usable GPU and fail instead
with ``CGX_UCX_REQUIRE_GPU=1`` (``conftest.py``, ``benchmarks/gpu_check.sh``).

Error bounds checked per element (unit = the bucket's stored float32 unit):

- round to nearest: ``|x - decode| <= unit/2 + slack``;
- stochastic: ``|x - decode| < unit + slack``;

``slack = unit * levels * 2**-20 + (|min| + |max|) * 2**-21 + 2**-140``: the float32 roundings
of ``x - min``, of the division, of ``unit`` itself (scaled by up to ``levels`` codes) and of
``min + unit * code`` (relative 2**-24 each, taken with a 4x-16x margin), plus an absolute
term for subnormal ranges.
"""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cgx_ucx.compression import (
    HEADER_NBYTES,
    CodecHeader,
    ErrorFeedback,
    backend_name,
    cpu,
    decode,
    decode_add,
    encode,
    encode_decode,
    encode_sum,
    encoded_nbytes,
    read_header,
    reduce_encode,
    reference,
)
from cgx_ucx.compression.kernels import compiling_here
from cgx_ucx.errors import CodecError, ConfigError

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
BITS = [1, 2, 3, 4, 5, 6, 7, 8]
SETTINGS = settings(
    max_examples=150,
    deadline=None,  # the first example compiles Numba kernels
    suppress_health_check=[HealthCheck.too_slow],
)


class Backend:
    """The public codec (Numba) or the NumPy reference, with the same three calls."""

    def __init__(self, name: str) -> None:
        self.name = name
        mod = reference if name == "numpy" else sys.modules["cgx_ucx.compression"]
        self.encode, self.decode, self.decode_add = mod.encode, mod.decode, mod.decode_add


@pytest.fixture(autouse=True, scope="module")
def kernels_compiled_on_use() -> Any:
    """Host calls run the Numba kernels, compiled on first use, even where a connect in
    this process made them compile in the background (the NumPy reference stands in)."""
    with compiling_here():
        yield


@pytest.fixture(params=["numba", "numpy"])
def be(request: pytest.FixtureRequest) -> Backend:
    return Backend(request.param)


def make_values(seed: int, n: int, dtype: np.dtype, kind: str) -> np.ndarray:
    """Test data of several shapes: wide/narrow scales, offsets, repeats."""
    rng = np.random.default_rng(seed)
    lo, hi = (-3, 3) if dtype == np.float16 else (-20, 20)
    scale = 10.0 ** rng.uniform(lo, hi)
    if kind == "normal":
        x = rng.standard_normal(n) * scale
    elif kind == "offset":  # large offset, small spread: precision of min + unit * code
        x = scale + rng.standard_normal(n) * scale * 1e-3
    elif kind == "levels":  # few distinct values, constant runs
        x = rng.integers(-3, 4, n) * scale
    else:  # heavy tails
        x = rng.standard_cauchy(n) * scale
    # finite in the dtype, and max - min finite in float32 (overflow is tested on its own)
    limit = min(float(ml_dtypes.finfo(dtype).max), float(np.finfo(np.float32).max)) / 4
    return np.clip(x, -limit, limit).astype(dtype)


def bucket_stats(x32: np.ndarray, bucket: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per element: the float32 unit and the slack of the bound (see module docstring)."""
    starts = np.arange(0, x32.size, bucket)
    mn = np.minimum.reduceat(x32, starts)
    mx = np.maximum.reduceat(x32, starts)
    levels = (1 << bits) - 1
    unit = ((mx - mn) / np.float32(levels)).astype(np.float64)
    slack = (
        unit * levels * 2.0**-20
        + (np.abs(mn.astype(np.float64)) + np.abs(mx.astype(np.float64))) * 2.0**-21
        + 2.0**-140
    )
    return np.repeat(unit, bucket)[: x32.size], np.repeat(slack, bucket)[: x32.size]


def as32(buf: np.ndarray) -> np.ndarray:
    return decode(buf, out=np.empty(read_header(buf).numel, np.float32))


def host(a: Any) -> np.ndarray:
    """A NumPy array as it is, a CuPy array copied to the host."""
    return a if isinstance(a, np.ndarray) else a.get()


def address(a: Any) -> int:
    """Where a NumPy or CuPy array's data starts."""
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


def values(n: int, dtype: np.dtype, seed: int) -> np.ndarray:
    """One random scale over the whole array, a few zeros and a constant run."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3)).astype(dtype)
    if n > 100:
        x[rng.integers(0, n, 5)] = 0.0
        x[n // 3 : n // 3 + 64] = x[n // 3]
    return x


cases = st.tuples(
    st.integers(0, 2**32 - 1),  # data seed
    st.integers(0, 2100),  # numel
    st.sampled_from(BITS),
    st.sampled_from([1, 3, 7, 8, 12, 100, 256, 1024]),  # bucket size, several not % 8
    st.sampled_from(DTYPES),
    st.sampled_from(["normal", "offset", "levels", "cauchy"]),
)


# ---------------------------------------------------------------------------------------
# error bounds


@pytest.mark.timeout(120)
@SETTINGS
@given(case=cases)
def test_round_to_nearest_error_at_most_half_a_unit(case: tuple) -> None:
    seed, n, bits, bucket, dtype, kind = case
    x = make_values(seed, n, dtype, kind)
    buf = encode(x, bits, bucket)
    x32 = x.astype(np.float32).astype(np.float64)
    if n == 0:
        assert decode(buf).size == 0
        return
    unit, slack = bucket_stats(x.astype(np.float32), bucket, bits)
    err = np.abs(as32(buf).astype(np.float64) - x32)
    assert np.all(err <= unit / 2 + slack), (err - unit / 2 - slack).max()


@pytest.mark.timeout(120)
@SETTINGS
@given(case=cases, rseed=st.integers(0, 2**64 - 1))
def test_stochastic_error_below_one_unit(case: tuple, rseed: int) -> None:
    seed, n, bits, bucket, dtype, kind = case
    x = make_values(seed, n, dtype, kind)
    buf = encode(x, bits, bucket, stochastic=True, seed=rseed)
    assert read_header(buf).stochastic
    if n == 0:
        return
    unit, slack = bucket_stats(x.astype(np.float32), bucket, bits)
    err = np.abs(as32(buf).astype(np.float64) - x.astype(np.float32).astype(np.float64))
    assert np.all(err < unit + slack)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_stochastic_rounding_is_unbiased(bits: int) -> None:
    # One bucket whose min and max are fixed, so (unit, min) are the same for every seed.
    # Per element the decoded value is min + unit*(floor(t) + Bernoulli(frac(t))): over S
    # seeds its mean error has standard deviation <= unit/(2 sqrt(S)). We require every one
    # of the 512 means within 6 of those (a false alarm has probability < 1e-6) and the
    # grand mean within 6 / sqrt(512) of it.
    n, seeds = 512, 2000
    rng = np.random.default_rng(bits)
    x = rng.uniform(-1.0, 1.0, n).astype(np.float32)
    x[0], x[1] = -1.0, 1.0
    acc = np.zeros(n, np.float64)
    out = np.empty(encoded_nbytes(n, bits, n), np.uint8)
    dec = np.empty(n, np.float32)
    for s in range(seeds):
        decode(encode(x, bits, n, out=out, stochastic=True, seed=s), out=dec)
        acc += dec
    unit = float(np.frombuffer(out[HEADER_NBYTES : HEADER_NBYTES + 4], np.float32)[0])
    mean_err = acc / seeds - x
    sigma = unit / (2 * np.sqrt(seeds))
    assert np.all(np.abs(mean_err) <= 6 * sigma), np.abs(mean_err).max() / sigma
    assert abs(mean_err.mean()) <= 6 * sigma / np.sqrt(n)
    # and it is not round-to-nearest in disguise: RTN's error on this data is biased
    rtn_err = as32(encode(x, bits, n)) - x
    assert np.abs(rtn_err).max() > 6 * sigma


def test_stochastic_is_reproducible_and_seeded() -> None:
    x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    a = encode(x, 3, 100, stochastic=True, seed=42)
    assert np.array_equal(a, encode(x, 3, 100, stochastic=True, seed=42))
    assert not np.array_equal(a, encode(x, 3, 100, stochastic=True, seed=43))
    assert not np.array_equal(a, encode(x, 3, 100))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_constant_buckets_decode_exactly(dtype: np.dtype, bits: int) -> None:
    rng = np.random.default_rng(bits)
    bucket = 37
    consts = rng.standard_normal(9).astype(dtype)
    consts[3] = 0
    x = np.repeat(consts, bucket)[: 9 * bucket - 5]
    for st_ in (False, True):
        y = decode(encode(x, bits, bucket, stochastic=st_, seed=1))
        assert y.dtype == dtype
        assert np.array_equal(y, x)


# ---------------------------------------------------------------------------------------
# sizes, bit widths, dtypes, RAW


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 9, 255, 256, 257, 1000])
@pytest.mark.parametrize("bits", [*BITS, 32])
def test_sizes_bits_dtypes(be: Backend, dtype: np.dtype, n: int, bits: int) -> None:
    bucket = 256
    x = make_values(n + bits, n, dtype, "normal")
    buf = be.encode(x, bits, bucket)
    assert buf.dtype == np.uint8 and buf.shape == (encoded_nbytes(n, bits, bucket, dtype),)
    hdr = read_header(buf)
    assert hdr == CodecHeader(bits, bucket, n, dtype, False)
    y = be.decode(buf)
    assert y.dtype == dtype and y.shape == (n,)
    if bits == 32:
        assert np.array_equal(y.view(np.uint8), x.view(np.uint8))
    elif n:
        unit, slack = bucket_stats(x.astype(np.float32), bucket, bits)
        err = np.abs(as32(buf).astype(np.float64) - x.astype(np.float64))
        assert np.all(err <= unit / 2 + slack)
    acc = np.arange(n, dtype=np.float32)
    assert be.decode_add(buf, acc) is acc
    assert np.array_equal(acc, np.arange(n, dtype=np.float32) + as32(buf))


def test_encoded_nbytes_formula() -> None:
    assert HEADER_NBYTES == 24
    assert encoded_nbytes(0, 4, 1024) == 24
    assert encoded_nbytes(1, 4, 1024) == 24 + 8 + 1
    assert encoded_nbytes(1025, 4, 1024) == 24 + 16 + 513
    assert encoded_nbytes(10, 3, 4) == 24 + 3 * 8 + 4  # 30 bits -> 4 bytes
    assert encoded_nbytes(10, 32, 4) == 24 + 40
    assert encoded_nbytes(10, 32, 4, np.float16) == 24 + 20
    assert encoded_nbytes(10, 32, 4, BF16) == 24 + 20
    # CGX's 4 bits with B = 1024 costs 4.0625 bits per value
    assert encoded_nbytes(1 << 20, 4, 1024) == 24 + 8 * 1024 + (1 << 19)


def test_bit_layout_is_little_endian_stream() -> None:
    # bucket 0..7 -> codes 0..7 with unit 1: 3-bit stream 000 100 010 110 ... LSB first
    x = np.arange(8, dtype=np.float32)
    buf = encode(x, 3, 8)
    meta = np.frombuffer(buf[24:32].tobytes(), np.float32)
    assert meta.tolist() == [1.0, 0.0]
    stream = sum(int(c) << (3 * i) for i, c in enumerate(range(8)))
    assert buf[32:].tobytes() == stream.to_bytes(3, "little")


def test_header_layout() -> None:
    buf = encode(np.ones(5, np.float16), 6, 3, stochastic=True, seed=9)
    assert buf[:4].tobytes() == b"CGXQ"
    assert buf[4:8].tolist() == [1, 6, 1, 1]  # version, bits, dtype float16, stochastic
    assert int.from_bytes(buf[8:12].tobytes(), "little") == 3
    assert int.from_bytes(buf[12:20].tobytes(), "little") == 5
    assert buf[20:24].tolist() == [0, 0, 0, 0]


# ---------------------------------------------------------------------------------------
# Numba bytes == NumPy reference bytes


@pytest.mark.timeout(120)
@SETTINGS
@given(case=cases, stochastic=st.booleans(), rseed=st.integers(0, 2**64 - 1))
def test_numba_matches_reference_bytes(case: tuple, stochastic: bool, rseed: int) -> None:
    seed, n, bits, bucket, dtype, kind = case
    x = make_values(seed, n, dtype, kind)
    if n > 3:
        x[seed % n] = [np.nan, np.inf, -np.inf, 0.0][seed % 4]
    a = encode(x, bits, bucket, stochastic=stochastic, seed=rseed)
    b = reference.encode(x, bits, bucket, stochastic=stochastic, seed=rseed)
    assert np.array_equal(a, b)
    for out_dtype in (np.float32, dtype):
        ya = decode(a, out=np.empty(n, out_dtype))
        yb = reference.decode(a, out=np.empty(n, out_dtype))
        assert np.array_equal(ya.view(np.uint8), yb.view(np.uint8))
    acc_a = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    acc_b = acc_a.copy()
    decode_add(a, acc_a)
    reference.decode_add(a, acc_b)
    assert np.array_equal(acc_a.view(np.uint32), acc_b.view(np.uint32))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16])
def test_parallel_kernels_match_reference(dtype: np.dtype) -> None:
    n = cpu.PARALLEL_MIN_NUMEL * 3 + 5
    x = make_values(7, n, dtype, "normal")
    for bits, bucket, stochastic in [(4, 1024, False), (3, 1000, True)]:
        a = encode(x, bits, bucket, stochastic=stochastic, seed=3)
        assert np.array_equal(a, reference.encode(x, bits, bucket, stochastic=stochastic, seed=3))
        assert np.array_equal(decode(a).view(np.uint8), reference.decode(a).view(np.uint8))
        acc = np.ones(n, np.float32)
        decode_add(a, acc)
        assert np.array_equal(acc, np.float32(1) + reference.decode(a, out=np.empty(n, np.float32)))
        for threads in (1, 3):  # all on the calling thread; more helpers than cores
            cpu.set_num_threads(threads)
            try:
                assert np.array_equal(encode(x, bits, bucket, stochastic=stochastic, seed=3), a)
                assert np.array_equal(decode(a), reference.decode(a))
            finally:
                cpu.set_num_threads(None)
    with pytest.raises(ConfigError):
        cpu.set_num_threads(0)


def test_codec_threads_shared_again_when_the_ranks_on_the_host_change(monkeypatch) -> None:
    """Each connect shares the cores out among the ranks on this host (a process group
    re-formed with more ranks gets a smaller share, and its share back with fewer),
    unless the user chose a count, which stays."""
    from cgx_ucx.collectives import bootstrap
    from cgx_ucx.compression import cpu_threads

    monkeypatch.setattr(bootstrap, "usable_cores", lambda: 8)
    cpu_threads.set_num_threads(None)
    try:
        for ranks, share in [(1, 8), (3, 2), (1, 8), (16, 1), (2, 4)]:
            bootstrap.share_codec_threads(ranks)
            assert cpu_threads.num_threads() == share
            assert not cpu_threads.threads_chosen()
        cpu_threads.set_num_threads(5)
        bootstrap.share_codec_threads(3)
        assert cpu_threads.num_threads() == 5 and cpu_threads.threads_chosen()
        cpu_threads.set_num_threads(None)
        bootstrap.share_codec_threads(3)
        assert cpu_threads.num_threads() == 2
    finally:
        cpu_threads.set_num_threads(None)


def test_decode_into_other_float_dtypes(be: Backend) -> None:
    x = make_values(1, 3000, np.dtype(np.float32), "normal")
    for bits in (4, 32):
        buf = be.encode(x, bits, 128)
        y32 = be.decode(buf)
        for dt in (np.float16, BF16, np.float64):
            y = be.decode(buf, out=np.empty(3000, dt))
            assert np.array_equal(y, y32.astype(dt))


# ---------------------------------------------------------------------------------------
# non-finite values


#: NaNs of either sign and with any payload, and the infinities (float32 bits).
NONFINITE_BITS = [0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0xFF800001, 0xFFFFFFFF,
                  0x7F800000, 0xFF800000]  # fmt: skip


@pytest.mark.parametrize("bits", NONFINITE_BITS, ids=hex)
def test_every_nonfinite_float32_marks_its_bucket(be: Backend, bits: int) -> None:
    """Whatever the NaN's sign and payload, beside the largest or smallest finite values
    of either sign, a bucket holding it decodes as NaN and its neighbours stay finite."""
    bad = np.array([bits], np.uint32).view(np.float32)[0]
    big = np.finfo(np.float32).max
    for neighbour in (big, -big, 0.0, -0.0, 1e-45):
        x = np.full(12, neighbour, np.float32)
        x[4:8] = [1.0, bad, -2.0, neighbour]
        y = be.decode(be.encode(x, 4, 4))
        assert np.isnan(y[4:8]).all() and np.isfinite(y[:4]).all() and np.isfinite(y[8:]).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_bucket_decodes_nonfinite_only_there(
    be: Backend, bad: float, dtype: np.dtype
) -> None:
    bucket, n = 64, 64 * 5 + 11
    x = make_values(3, n, dtype, "normal")
    x[2 * bucket + 17] = bad
    x[n - 2] = bad  # in the short last bucket
    for bits in (1, 4, 7):
        for st_ in (False, True):
            y = be.decode(be.encode(x, bits, bucket, stochastic=st_, seed=5))
            finite = np.isfinite(y.astype(np.float32))
            expect = np.ones(n, bool)
            expect[2 * bucket : 3 * bucket] = False
            expect[5 * bucket :] = False
            assert np.array_equal(finite, expect)
            acc = np.zeros(n, np.float32)
            be.decode_add(be.encode(x, bits, bucket), acc)
            assert np.array_equal(np.isfinite(acc), expect)


def test_range_overflow_bucket_is_nonfinite(be: Backend) -> None:
    # max - min beyond float32's range cannot give a finite unit: treated as overflow
    x = np.array([-3e38, 3e38, 1.0, 2.0], np.float32)
    y = be.decode(be.encode(x, 4, 2))
    assert np.isnan(y[:2]).all() and np.isfinite(y[2:]).all()


# ---------------------------------------------------------------------------------------
# buffers: out=, no allocation, validation


def test_out_buffers_are_reused_not_allocated() -> None:
    x = make_values(0, 5000, np.dtype(np.float32), "normal")
    need = encoded_nbytes(5000, 4, 512)
    out = np.zeros(need + 100, np.uint8)
    buf = encode(x, 4, 512, out=out)
    assert buf.shape == (need,) and np.shares_memory(buf, out)
    assert buf.ctypes.data == out.ctypes.data
    assert np.all(out[need:] == 0)
    dec = np.empty(5000, np.float32)
    assert decode(buf, out=dec) is dec
    acc = np.zeros(5000, np.float32)
    assert decode_add(buf, acc) is acc
    assert np.array_equal(acc, dec)
    # RAW into out, too
    raw = encode(x, 32, 512, out=np.empty(encoded_nbytes(5000, 32, 512), np.uint8))
    assert np.array_equal(decode(raw), x)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("offset", [1, 2, 3, 5])
def test_segments_at_unaligned_offsets(xp: ModuleType, offset: int) -> None:
    # segments are packed back to back in one message: meta and values at any address
    x = make_values(offset, 300_001, np.dtype(np.float32), "normal")  # shared with helpers
    xd = xp.asarray(x)
    for bits, bucket in ((4, 1024), (3, 100)):
        need = encoded_nbytes(x.size, bits, bucket)
        msg = xp.zeros(need + offset + 8, xp.uint8)
        seg = encode(xd, bits, bucket, out=msg[offset:])
        assert address(seg) == address(msg) + offset
        want = reference.encode(x, bits, bucket)
        assert np.array_equal(host(seg), want)
        msg_h = host(msg)
        assert np.all(msg_h[:offset] == 0) and np.all(msg_h[offset + need :] == 0)
        assert np.array_equal(host(decode(seg)), reference.decode(want))
        acc = xp.ones(x.size, xp.float32)
        decode_add(seg, acc)
        assert np.array_equal(host(acc), np.float32(1) + reference.decode(want))
    # every dtype and RAW, decoded into every float dtype
    for bits in (4, 32):
        for dtype in DTYPES:
            x = values(3001, dtype, seed=offset)
            need = encoded_nbytes(3001, bits, 256, dtype)
            big = xp.zeros(need + 16, xp.uint8)
            seg = encode(xp.asarray(x), bits, 256, out=big[offset:])
            assert address(seg) == address(big) + offset and seg.size == need
            assert np.array_equal(host(seg), encode(x, bits, 256))
            for out_dtype in (np.float32, np.float16, BF16, np.float64):
                y = decode(seg, out=xp.empty(3001, out_dtype))
                want = decode(host(seg), out=np.empty(3001, out_dtype))
                assert np.array_equal(host(y).view(np.uint8), want.view(np.uint8))
            acc = xp.ones(3001, xp.float32)
            decode_add(seg, acc)
            assert np.array_equal(
                host(acc), np.float32(1) + decode(host(seg), out=np.empty(3001, np.float32))
            )


def test_decode_accepts_bytes_like() -> None:
    x = np.linspace(-1, 1, 100, dtype=np.float32)
    buf = encode(x, 8, 16)
    for form in (buf.tobytes(), bytearray(buf.tobytes()), memoryview(buf.tobytes())):
        assert np.array_equal(decode(form), decode(buf))


def test_backend_name() -> None:
    assert backend_name(np.zeros(3, np.float32)) == "numba"


@pytest.mark.parametrize(
    "kwargs",
    [{"bits": 0}, {"bits": 9}, {"bits": 16}, {"bits": 4.0}, {"bits": True}, {"bucket_size": 0},
     {"bucket_size": 2**32}, {"seed": -1}, {"seed": 2**64}],
)  # fmt: skip
def test_bad_configuration_raises_config_error(kwargs: dict) -> None:
    args = {"bits": 4, "bucket_size": 16} | kwargs
    with pytest.raises(ConfigError):
        encode(np.ones(10, np.float32), args.pop("bits"), args.pop("bucket_size"), **args)


@pytest.mark.parametrize(
    "x",
    [np.ones((2, 3), np.float32), np.ones(10, np.float64), np.ones(10, np.int32),
     np.ones(20, np.float32)[::2], [1.0, 2.0]],
)  # fmt: skip
def test_bad_values_raise_codec_error(x: object) -> None:
    with pytest.raises(CodecError):
        encode(x, 4)


def test_bad_out_and_acc_raise_codec_error() -> None:
    x = np.ones(100, np.float32)
    need = encoded_nbytes(100, 4, 16)
    for out in (
        np.empty(need - 1, np.uint8),
        np.empty(need, np.int8),
        np.empty((need, 1), np.uint8),
    ):
        with pytest.raises(CodecError):
            encode(x, 4, 16, out=out)
    buf = encode(x, 4, 16)
    for out in (np.empty(99, np.float32), np.empty(100, np.int32), np.empty(101, np.float32)):
        with pytest.raises(CodecError):
            decode(buf, out=out)
    for acc in (np.zeros(100, np.float64), np.zeros(100, np.float16), np.zeros(99, np.float32)):
        with pytest.raises(CodecError):
            decode_add(buf, acc)
    ro = np.zeros(100, np.float32)
    ro.flags.writeable = False
    with pytest.raises(CodecError):
        decode_add(buf, ro)


# ---------------------------------------------------------------------------------------
# encode_decode: the owner's requantization (encode, and decode its own bytes) in one pass


@pytest.mark.timeout(120)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=cases,
    stochastic=st.booleans(),
    rseed=st.integers(0, 2**64 - 1),
    target=st.sampled_from(["in place", "float32", "same dtype", "float64"]),
)
def test_encode_decode_equals_encode_then_decode(
    case: tuple, stochastic: bool, rseed: int, target: str
) -> None:
    seed, n, bits, bucket, dtype, kind = case
    x = make_values(seed, n, dtype, kind)
    if n > 3:
        x[seed % n] = [np.nan, np.inf, -np.inf, 0.0][seed % 4]
    want = encode(x, bits, bucket, stochastic=stochastic, seed=rseed)
    out_dtype = {"in place": dtype, "float32": np.float32, "same dtype": dtype}.get(
        target, np.float64
    )
    expect = decode(want, out=np.empty(n, out_dtype))
    src = x.copy()
    dst = src if target == "in place" else np.full(n, 7, out_dtype)
    got = encode_decode(src, bits, bucket, decoded=dst, stochastic=stochastic, seed=rseed)
    assert np.array_equal(got, want)
    assert np.array_equal(dst.view(np.uint8), expect.view(np.uint8))
    if target != "in place":
        assert np.array_equal(src.view(np.uint8), x.view(np.uint8))  # the input is untouched


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", [1, 3])
def test_encode_decode_parallel_in_place(threads: int) -> None:
    n = cpu.PARALLEL_MIN_NUMEL * 3 + 5
    x = make_values(11, n, np.dtype(np.float32), "normal")
    cpu.set_num_threads(threads)
    try:
        for bits, bucket, stochastic in [(4, 1024, False), (3, 1000, True)]:
            want = encode(x, bits, bucket, stochastic=stochastic, seed=5)
            y = x.copy()
            out = np.empty(want.size + 3, np.uint8)
            got = encode_decode(y, bits, bucket, decoded=y, out=out, stochastic=stochastic, seed=5)
            assert np.array_equal(got, want) and got.ctypes.data == out.ctypes.data
            assert np.array_equal(y.view(np.uint32), decode(want).view(np.uint32))
    finally:
        cpu.set_num_threads(None)


def test_encode_decode_shifted_overlap_is_still_exact() -> None:
    """``decoded`` overlapping ``x`` at another offset: the values must be those of the
    original ``x`` (no bucket read after a neighbour's decoded values were written)."""
    base = make_values(3, 5100, np.dtype(np.float32), "normal")
    for shift in (1, 8, 1024):
        mem = base.copy()
        x, dec = mem[:4000], mem[shift : shift + 4000]
        want = encode(x.copy(), 4, 64)
        got = encode_decode(x, 4, 64, decoded=dec)
        assert np.array_equal(got, want)
        assert np.array_equal(dec, decode(want))


def test_encode_decode_reference_backend_agrees() -> None:
    x = make_values(5, 3001, np.dtype(np.float16), "normal")
    a, b = np.empty(3001, np.float32), np.empty(3001, np.float32)
    ba = encode_decode(x, 5, 100, decoded=a, stochastic=True, seed=9)
    bb = reference.encode_decode(x, 5, 100, decoded=b, stochastic=True, seed=9)
    assert np.array_equal(ba, bb) and np.array_equal(a, b)


@pytest.mark.timeout(120)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=cases,
    stochastic=st.booleans(),
    rseed=st.integers(0, 2**64 - 1),
    divisor=st.sampled_from([0, 2, 3, 7]),
    peer_bits=st.sampled_from(["same", 32, 3]),
    target=st.sampled_from(["in place", "float32", "same dtype"]),
)
def test_reduce_encode_equals_its_three_steps(
    case: tuple, stochastic: bool, rseed: int, divisor: int, peer_bits: Any, target: str
) -> None:
    """acc += decode(peer); acc /= divisor; encode_decode(acc): the same bytes, accumulator
    and decoded values, whether the one-pass kernel applies (same width and bucket) or not
    (another width in, or an uncompressed segment)."""
    seed, n, bits, bucket, dtype, kind = case
    peer_values = make_values(seed + 1, n, dtype, kind)
    if n > 5:
        peer_values[(seed // 7) % n] = [np.nan, np.inf, 1.0][seed % 3]
    peer = encode(peer_values, bits if peer_bits == "same" else peer_bits, bucket)
    acc0 = make_values(seed, n, np.dtype(np.float32), kind)
    out_dtype = dtype if target == "same dtype" else np.float32  # in place: acc's float32

    want_acc = acc0.copy()
    decode_add(peer, want_acc)
    if divisor:
        np.divide(want_acc, divisor, out=want_acc)
    want_dec = np.empty(n, out_dtype)
    want = encode_decode(
        want_acc.copy(), bits, bucket, decoded=want_dec, stochastic=stochastic, seed=rseed
    )
    acc = acc0.copy()
    dec = acc if target == "in place" else np.full(n, 5, out_dtype)
    kw = {"decoded": dec, "divisor": divisor, "stochastic": stochastic, "seed": rseed}
    got = reduce_encode(peer, acc, bits, bucket, **kw)
    assert np.array_equal(got, want)
    if target == "in place":
        assert np.array_equal(acc.view(np.uint8), want_dec.view(np.uint8))
    else:
        assert np.array_equal(acc.view(np.uint32), want_acc.view(np.uint32))
        assert np.array_equal(dec.view(np.uint8), want_dec.view(np.uint8))
    ref_acc = acc0.copy()
    ref_dec = ref_acc if target == "in place" else np.empty(n, out_dtype)
    ref = reference.reduce_encode(peer, ref_acc, bits, bucket, **{**kw, "decoded": ref_dec})
    assert np.array_equal(ref, want)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", [1, 3])
def test_reduce_encode_parallel_in_place(threads: int) -> None:
    n = cpu.PARALLEL_MIN_NUMEL * 3 + 5
    peer = encode(make_values(12, n, np.dtype(np.float32), "normal"), 4, 1000)
    acc0 = make_values(13, n, np.dtype(np.float32), "normal")
    want_acc = acc0.copy()
    decode_add(peer, want_acc)
    np.divide(want_acc, 2, out=want_acc)
    want = encode(want_acc, 4, 1000, stochastic=True, seed=4)
    cpu.set_num_threads(threads)
    try:
        acc = acc0.copy()
        got = reduce_encode(peer, acc, 4, 1000, decoded=acc, divisor=2, stochastic=True, seed=4)
    finally:
        cpu.set_num_threads(None)
    assert np.array_equal(got, want)
    assert np.array_equal(acc.view(np.uint32), decode(want).view(np.uint32))


def test_reduce_encode_bad_arguments_raise_codec_error() -> None:
    peer = encode(np.ones(100, np.float32), 4, 16)
    acc = np.zeros(100, np.float32)
    for kwargs in (
        {"decoded": np.empty(99, np.float32)},
        {"decoded": acc, "divisor": -1},
        {"decoded": acc, "divisor": 1.5},
        {"decoded": acc, "divisor": True},
    ):
        with pytest.raises(CodecError):
            reduce_encode(peer, acc, 4, 16, **kwargs)
    for bad_acc in (np.zeros(100, np.float64), np.zeros(99, np.float32)):
        with pytest.raises(CodecError):
            reduce_encode(peer, bad_acc, 4, 16, decoded=np.empty(bad_acc.size, np.float32))
    with pytest.raises(CodecError):
        reduce_encode(peer[:-1], acc, 4, 16, decoded=acc)  # a truncated segment
    assert np.array_equal(acc, np.zeros(100, np.float32))  # nothing was written


def test_encode_decode_bad_decoded_raises_codec_error() -> None:
    x = np.ones(100, np.float32)
    ro = np.zeros(100, np.float32)
    ro.flags.writeable = False
    for dec in (
        np.empty(99, np.float32),
        np.empty(100, np.int32),
        np.empty((100, 1), np.float32),
        ro,
        [0.0] * 100,
    ):
        with pytest.raises(CodecError):
            encode_decode(x, 4, 16, decoded=dec)
    with pytest.raises(CodecError):
        encode_decode(np.ones(100, np.int32), 4, 16, decoded=np.empty(100, np.float32))


# ---------------------------------------------------------------------------------------
# conversions of the Numba kernels (all float16 and bfloat16 bit patterns)


@pytest.fixture(scope="module")
def conversions() -> tuple[object, object]:
    """The kernels' own element conversions (cpu._load / cpu._store) in tiny loops."""
    from numba import njit

    @njit
    def to_float(src, out):
        for i in range(src.shape[0]):
            out[i] = cpu._load(src, i)

    @njit
    def from_float(src, out):
        for i in range(src.shape[0]):
            cpu._store(out, i, src[i])

    return to_float, from_float


def test_half_to_float_all_patterns(conversions: tuple) -> None:
    to_float, _ = conversions
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    for dt, kernel_bits in ((np.dtype(np.float16), bits), (BF16, bits.view(np.int16))):
        got = np.empty(65536, np.float32)
        to_float(kernel_bits, got)
        want = bits.view(dt).astype(np.float32)
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_float_to_half_rounds_like_numpy(conversions: tuple) -> None:
    _, from_float = conversions
    rng = np.random.default_rng(0)
    f = rng.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32)
    # plus ties, boundaries, subnormals, overflow thresholds
    edges = [0x00000000, 0x80000000, 0x33000000, 0x33000001, 0x387FC000, 0x38800000, 0x477FEFFF,
             0x477FF000, 0x47800000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x3F801000, 0x3F803000,
             0x3F808000, 0x3F818000, 0x7F7FFFFF]  # fmt: skip
    vals = np.concatenate([f, np.array(edges, np.uint32)]).view(np.float32)
    for dt, kernel_dt in ((np.dtype(np.float16), np.uint16), (BF16, np.int16)):
        with np.errstate(over="ignore", invalid="ignore"):
            want = vals.astype(dt)
        got = np.empty(vals.size, kernel_dt)
        from_float(vals, got)
        got = got.view(dt)
        nan = np.isnan(want.astype(np.float32))
        assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
        assert np.array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))


def test_raw_segments_convert_between_dtypes(be: Backend) -> None:
    x = (np.random.default_rng(4).standard_normal(999) * 100).astype(np.float32)
    for src_dt in DTYPES:
        xs = x.astype(src_dt)
        buf = be.encode(xs, 32, 16)
        for dt in (*DTYPES, np.dtype(np.float64)):
            y = be.decode(buf, out=np.empty(999, dt))
            assert np.array_equal(y, xs.astype(np.float32).astype(dt))
        # RAW at an odd address inside a larger message
        msg = np.zeros(buf.size + 3, np.uint8)
        msg[3:] = buf
        acc = np.ones(999, np.float32)
        be.decode_add(msg[3:], acc)
        assert np.array_equal(acc, np.float32(1) + xs.astype(np.float32))


# ---------------------------------------------------------------------------------------
# error feedback


def test_error_feedback_residual_and_telescoping_sum() -> None:
    ef = ErrorFeedback()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(1000).astype(np.float32) for _ in range(5)]
    sent = np.zeros(1000, np.float64)
    for t, x in enumerate(xs):
        before = ef.residual("w")
        comp = x + (0 if before is None else before)
        buf = ef.encode("w", x, 2, 128, seed=t)
        dec = decode(buf)
        assert np.array_equal(decode(encode(comp, 2, 128)), dec)
        np.testing.assert_array_equal(ef.residual("w"), comp - dec)
        sent += dec
    # what was sent plus what is still owed equals what was given (up to float32 rounding)
    total = np.sum(xs, axis=0, dtype=np.float64)
    np.testing.assert_allclose(sent + ef.residual("w"), total, atol=1e-4)


def test_error_feedback_compensate_update_state_dict() -> None:
    ef = ErrorFeedback()
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    assert np.array_equal(ef.compensate("a", x), x) and "a" not in ef
    dec = decode(encode(x, 1, 64))
    ef.update("a", x, dec)
    assert np.array_equal(ef.residual("a"), x - dec)
    np.testing.assert_array_equal(ef.compensate("a", x), x + (x - dec))
    y = x.copy()
    assert ef.compensate("a", y, out=y) is y  # in place
    state = ef.state_dict()
    ef2 = ErrorFeedback()
    ef2.load_state_dict(state)
    assert np.array_equal(ef2.residual("a"), ef.residual("a")) and len(ef2) == 1
    with pytest.raises(CodecError):
        ef.compensate("a", np.ones(65, np.float32))
    ef.reset("a")
    assert "a" not in ef
    xh = x.astype(np.float16)
    assert ef.compensate("h", xh).dtype == np.float32


# ---------------------------------------------------------------------------------------
# one body for the host (xp=numpy: Numba) and the GPU (xp=cupy)


@pytest.mark.timeout(120)
def test_small_cases_equal_reference(xp: ModuleType) -> None:
    for n, bits, bucket in [(13, 3, 4), (600, 7, 7), (2500, 6, 2048), (9000, 8, 512)]:
        for dtype in DTYPES:
            x = values(n, dtype, seed=bits)
            x[n // 2] = np.nan
            ref = reference.encode(x, bits, bucket, stochastic=True, seed=5)
            got = encode(xp.asarray(x), bits, bucket, stochastic=True, seed=5)
            assert np.array_equal(host(got), ref)
            assert np.array_equal(
                host(decode(got, out=xp.empty(n, np.float64))),
                reference.decode(ref, out=np.empty(n, np.float64)),
                equal_nan=True,
            )


@pytest.mark.timeout(60)
def test_nonfinite_buckets_and_constants(xp: ModuleType) -> None:
    x = np.repeat(np.float32([1.5, -2.0, 0.0, 7.0]), 64)
    x[70] = np.inf
    y = host(decode(encode(xp.asarray(x), 4, 64)))
    assert np.array_equal(np.isfinite(y), np.arange(256) // 64 != 1)
    assert np.array_equal(y[np.isfinite(y)], x[np.isfinite(y)])


@pytest.mark.timeout(60)
def test_subnormals_are_not_flushed(xp: ModuleType) -> None:
    # CuPy's RawModule would compile with -ftz=true; no backend may flush subnormals
    rng = np.random.default_rng(3)
    f32 = (rng.standard_normal(5000) * 1e-39).astype(np.float32)  # float32 subnormals
    f16 = (rng.standard_normal(5000) * 1e-6).astype(np.float16)  # float16 subnormals
    for x in (f32, f16):
        for bits in (2, 8, 32):
            for stochastic in (False, True):
                got = encode(xp.asarray(x), bits, 128, stochastic=stochastic, seed=1)
                want = reference.encode(x, bits, 128, stochastic=stochastic, seed=1)
                assert np.array_equal(host(got), want)
            y = decode(xp.asarray(want), out=xp.empty(5000, xp.float32))
            assert np.array_equal(host(y), reference.decode(want, out=np.empty(5000, np.float32)))


# ---------------------------------------------------------------------------------------
# GPU only: the GPU's bytes against the CPU's over many sizes, streams, error feedback

GPU_SIZES_BUCKETS = [
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


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,bucket", GPU_SIZES_BUCKETS)
def test_gpu_bytes_equal_cpu_bytes(cp: ModuleType, n: int, bucket: int) -> None:
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


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_non_default_stream_and_validation(cp: ModuleType) -> None:
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


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_error_feedback_on_gpu(cp: ModuleType) -> None:
    ef_gpu, ef_cpu = ErrorFeedback(), ErrorFeedback()
    rng = np.random.default_rng(0)
    for step in range(3):
        x = rng.standard_normal(10_000).astype(np.float32)
        a = ef_gpu.encode("w", cp.asarray(x), 2, 256, seed=step)
        b = ef_cpu.encode("w", x, 2, 256, seed=step)
        assert np.array_equal(host(a), b)
    assert np.array_equal(ef_gpu.state_dict()["w"], ef_cpu.state_dict()["w"])


# ---------------------------------------------------------------------------------------
# import hygiene


def test_import_needs_neither_numba_nor_cupy() -> None:
    code = (
        "import sys, cgx_ucx, cgx_ucx.compression, numpy as np\n"
        "from cgx_ucx.compression import reference\n"
        "reference.encode(np.ones(4, np.float32), 4)\n"
        "bad = [m for m in ('numba', 'cupy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_helper_thread_errors_reach_the_caller() -> None:
    def run(c0: int, c1: int) -> None:
        if c0 > 0:
            raise ValueError("boom")

    cpu.set_num_threads(2)
    try:
        with pytest.raises(ValueError, match="boom"):
            cpu.run_chunks(run, cpu.PARALLEL_MIN_NUMEL, 64, cpu.BATCH_VALUES // 8)
    finally:
        cpu.set_num_threads(None)


@pytest.mark.timeout(120)
def test_codec_benchmark_writes_its_table(tmp_path: Any, capsys: pytest.CaptureFixture) -> None:
    import json

    from cgx_ucx.bench.codec import main

    args = ["--sizes", "0.25", "--bits", "4", "--repeat", "2", "--no-reference", "--quiet"]
    assert main([*args, "--out-dir", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "codec.json").read_text())["rows"]
    keys = ["encode_GBps", "decode_add_GBps", "requantize_GBps", "encode_then_decode_GBps"]
    for key in [*keys, "reduce_requantize_GBps", "decode_add_encode_decode_GBps"]:
        assert row[key] > 0, key
    assert "requant" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [2, 4, 32])
@pytest.mark.parametrize("stochastic", [False, True])
def test_encode_sum_writes_the_segment_of_the_sum(dtype, bits, stochastic):
    """encode_sum(x, y) is encode(x + y) byte for byte, the sum never written: the host
    kernels (compiled here), a read-only y (a peer's mapped bytes), buckets that end
    mid-way, and an uncompressed segment."""
    rng = np.random.default_rng(bits)
    n = 5000
    x = (rng.standard_normal(n) * 4).astype(dtype)
    y = (rng.standard_normal(n) * 4).astype(dtype)
    y.flags.writeable = False
    kept = x.copy()
    with compiling_here():
        got = encode_sum(x, y, bits, 512, stochastic=stochastic, seed=11)
    want = encode(x + y, bits, 512, stochastic=stochastic, seed=11)
    assert got.tobytes() == want.tobytes()
    assert x.tobytes() == kept.tobytes()  # the sum is not written into x


def test_encode_sum_refuses_an_addend_unlike_x():
    x = np.ones(64, np.float32)
    for y in (np.ones(64, np.float16), np.ones(63, np.float32), np.ones(128, np.float32)[::2]):
        with pytest.raises(CodecError, match="y must be"):
            encode_sum(x, y, 4)


@pytest.mark.parametrize("divisor", [0, 3])
@pytest.mark.parametrize("stochastic", [False, True])
def test_reduce_encode_adds_an_addend_first_in_the_same_pass(divisor, stochastic):
    """reduce_encode(..., addend=y) is acc += y then reduce_encode, bit for bit (segment,
    acc and decoded), in the host kernels' one pass (which runs here, compiled), with a
    read-only addend; an addend unlike acc is a CodecError."""
    rng = np.random.default_rng(divisor)
    n = 3000
    incoming = encode(rng.standard_normal(n).astype(np.float32), 4, 256)
    acc0 = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    y.flags.writeable = False
    want_acc, got_acc = acc0 + y, acc0.copy()
    want_dec, got_dec = np.empty(n, np.float32), np.empty(n, np.float32)
    kw = {"divisor": divisor, "stochastic": stochastic, "seed": 5}
    want = reduce_encode(incoming, want_acc, 4, 256, decoded=want_dec, **kw)
    with compiling_here():
        got = reduce_encode(incoming, got_acc, 4, 256, decoded=got_dec, addend=y, **kw)
        hdr = read_header(got)
        assert cpu.reduce_encode_into(
            incoming, read_header(incoming), acc0.copy(), divisor, hdr, 5, got.copy(),
            np.empty(n, np.float32), y,
        )  # fmt: skip
    assert got.tobytes() == want.tobytes()
    assert got_acc.tobytes() == want_acc.tobytes() and got_dec.tobytes() == want_dec.tobytes()
    with pytest.raises(CodecError, match="addend"):
        reduce_encode(incoming, acc0.copy(), 4, 256, decoded=got_dec, addend=y[:-1])
