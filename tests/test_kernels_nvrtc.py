"""The CUDA kernels without a GPU: NVRTC builds them, and a CPU emulation runs them.

1. Every ``kernels/*.cu`` compiles with NVRTC for sm_90 (PTX and a cubin) with the options
   the GPU backend uses, so a kernel build error fails CI on machines without a GPU.
2. The same source is compiled as C++ with a small emulation of the CUDA built-ins used
   (thread/block indices, ``__syncthreads`` and ``__shfl_xor_sync`` with real threads and
   barriers, ``__shared__`` as statics while blocks run one at a time, the ``*_rn``
   intrinsics as plain IEEE float32 with FP contraction off) and driven by
   :mod:`cgx_ucx.compression.gpu`'s own launch code. Its bytes must equal the NumPy
   reference: this checks the kernels' indexing, reductions, packing and conversions
   here; the ``gpu`` tests in ``tests/test_codec.py`` check the real thing on a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from cgx_ucx.arrays import to_host
from cgx_ucx.collectives import piece_codec
from cgx_ucx.collectives.piece_codec import (
    decode_add_piece,
    decode_piece,
    encode_piece,
    reduce_requantize_piece,
    requantize_piece,
)
from cgx_ucx.collectives.plan import Piece, Segment
from cgx_ucx.compression import codec, encode, encode_decode, encoded_nbytes, read_header, reference
from cgx_ucx.compression import gpu as G
from cgx_ucx.compression.codec import CodecHeader
from cgx_ucx.errors import CodecError

KERNEL_DIR = Path(__file__).resolve().parents[1] / "kernels"
SOURCES = sorted(KERNEL_DIR.glob("*.cu"))
BF16 = np.dtype(ml_dtypes.bfloat16)


def test_there_are_kernel_sources() -> None:
    assert [p.name for p in SOURCES] == [G.SOURCE]
    assert G.kernel_source() == (KERNEL_DIR / G.SOURCE).read_text()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_nvrtc_compiles_for_sm90(path: Path) -> None:
    # the backend's own build function and options, on every source
    ptx = G.compile_kernels("compute_90", path.read_text())
    assert len(ptx) > 1000
    entries = set(re.findall(rb"\.entry\s+(\w+)", ptx))
    if path.name == G.SOURCE:
        assert entries == {k.encode() for k in G.KERNELS}
    # IEEE float32 as on the CPU: no contraction into FMA, no flush to zero, exact division
    assert b"fma." not in ptx and b".ftz" not in ptx and b"div.approx" not in ptx
    cubin = G.compile_kernels("sm_90", path.read_text())
    assert len(cubin) > 1000 and cubin[:4] == b"\x7fELF"


def test_build_errors_are_codec_errors() -> None:
    with pytest.raises(CodecError, match="NVRTC cannot build"):
        G.compile_kernels("sm_90", 'extern "C" __global__ void k() { undefined_thing; }')
    assert G.target_arch(90) == "sm_90"
    assert G.target_arch(91).startswith("compute_")  # no NVRTC target: PTX of an older arch


# ---------------------------------------------------------------------------------------
# CPU emulation of the kernels

SHIM = r"""
#include <atomic>
#include <barrier>
#include <cstring>
#include <math.h>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

struct dim3 { unsigned int x = 1, y = 1, z = 1; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
  return {x, y, z, w};
}
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  /* blocks run one at a time */

static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline int atomicMin(int* p, int v) {
  std::atomic_ref<int> a(*p);
  int o = a.load();
  while (v < o && !a.compare_exchange_weak(o, v)) {}
  return o;
}
static inline int atomicMax(int* p, int v) {
  std::atomic_ref<int> a(*p);
  int o = a.load();
  while (v > o && !a.compare_exchange_weak(o, v)) {}
  return o;
}
static inline int atomicOr(int* p, int v) { return std::atomic_ref<int>(*p).fetch_or(v); }

static std::barrier<>* emu_block_barrier;
static std::barrier<>* emu_warp_barrier[32];
static unsigned long long emu_shfl[32][2][32];
static thread_local int emu_phase;
static inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
// every lane of the warp must call (as on the GPU with a full mask); double-buffered: a lane
// cannot overwrite a slot before every lane has read it. A source lane outside the warp
// gives the caller's own value, as __shfl_up_sync / __shfl_down_sync do.
template <class T> static T emu_shfl_from(T v, int src) {
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long u = 0;
  std::memcpy(&u, &v, sizeof(T));
  emu_shfl[warp][emu_phase][lane] = u;
  emu_warp_barrier[warp]->arrive_and_wait();
  if (src >= 0 && src < 32) u = emu_shfl[warp][emu_phase][src];
  emu_phase ^= 1;
  T r;
  std::memcpy(&r, &u, sizeof(T));
  return r;
}
template <class T> static T __shfl_xor_sync(unsigned, T v, int m) {
  return emu_shfl_from(v, (int)(threadIdx.x & 31) ^ m);
}
template <class T> static T __shfl_up_sync(unsigned, T v, int d) {
  return emu_shfl_from(v, (int)(threadIdx.x & 31) - d);
}
template <class T> static T __shfl_down_sync(unsigned, T v, int d) {
  return emu_shfl_from(v, (int)(threadIdx.x & 31) + d);
}
template <class T, class U> static T emu_cast(U u) {
  if constexpr (std::is_pointer_v<T>) return reinterpret_cast<T>(u); else return static_cast<T>(u);
}
template <class... P, class... A>
static void emu_launch(void (*k)(P...), unsigned grid, unsigned block, A... a) {
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned b = 0; b < grid; ++b) {
    std::barrier<> bb(block);
    emu_block_barrier = &bb;
    std::vector<std::unique_ptr<std::barrier<>>> wb;
    for (unsigned w = 0; w < block / 32; ++w) {
      wb.emplace_back(new std::barrier<>(32));
      emu_warp_barrier[w] = wb.back().get();
    }
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < block; ++t)
      ts.emplace_back([=] { threadIdx.x = t; blockIdx.x = b; k(emu_cast<P>(a)...); });
    for (auto& t : ts) t.join();
  }
}
"""

_CTYPE = {"P": "unsigned long long", "Q": "unsigned long long", "q": "long long", "i": "int"}
_CTYPES_PY = {"P": ctypes.c_uint64, "Q": ctypes.c_uint64, "q": ctypes.c_int64, "i": ctypes.c_int32}


def driver_source() -> str:
    lines = [SHIM, f'#include "{KERNEL_DIR / G.SOURCE}"']
    for name, kind in G.KERNELS.items():
        sig = G.SIGNATURES[kind]
        params = ", ".join(f"{_CTYPE[c]} a{i}" for i, c in enumerate(sig))
        args = ", ".join(f"a{i}" for i in range(len(sig)))
        lines.append(
            f'extern "C" void emu_{name}(unsigned grid, unsigned block, {params}) '
            f"{{ emu_launch({name}, grid, block, {args}); }}"
        )
    return "\n".join(lines) + "\n"


class EmulatedRunner:
    """gpu.Runner on host NumPy arrays: kernels run as C++ threads."""

    max_grid = 3  # small, so the grid-stride loops take several rounds

    def __init__(self, lib: ctypes.CDLL, stderr: Path) -> None:
        self.lib = lib
        self.stderr = stderr
        self.launches: list[tuple[str, int, int]] = []
        self.kept: list[np.ndarray] = []

    def launch(self, name: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        sig = G.SIGNATURES[G.KERNELS[name]]
        assert block % 32 == 0 and block <= G.BLOCK and grid >= 1
        fn = getattr(self.lib, f"emu_{name}")
        fn.argtypes = [ctypes.c_uint, ctypes.c_uint] + [_CTYPES_PY[c] for c in sig]
        fn.restype = None
        self.launches.append((name, grid, block))
        # the sanitizer reports on file descriptor 2: kept aside while the kernel runs
        saved = os.dup(2)
        with open(self.stderr, "w+b") as f:
            os.dup2(f.fileno(), 2)
            try:
                fn(grid, block, *(int(a) for a in args))
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            f.seek(0)
            report = f.read().decode(errors="replace")
        assert "runtime error" not in report, f"{name}: {report[:2000]}"

    def ptr(self, a: np.ndarray) -> int:
        return int(a.ctypes.data)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def upload(self, rows: np.ndarray) -> int:
        kept = np.array(rows, dtype=np.uint64)  # a copy, as on the device
        self.kept.append(kept)
        return int(kept.ctypes.data)

    def status(self) -> np.ndarray:
        return np.full(1, -1, np.int32)  # the kernel must write it

    def read_status(self, st: np.ndarray) -> int:
        return int(st[0])


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> EmulatedRunner:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is needed to emulate the CUDA kernels on the CPU")
    d = tmp_path_factory.mktemp("emu")
    (d / "driver.cpp").write_text(driver_source())
    lib = d / "libemu.so"
    flags = ["-std=c++20", "-O1", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC"]
    flags += ["-pthread", "-Wall", "-Wno-unused-function"]
    # a misaligned vector or word access (a fault on a GPU, harmless on x86) is reported
    flags += ["-fsanitize=alignment"]
    cmd = [gxx, *flags, "-o", str(lib), str(d / "driver.cpp")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-4000:]
    return EmulatedRunner(ctypes.CDLL(str(lib)), d / "stderr")


def gpu_encode(
    emu: EmulatedRunner, x: np.ndarray, bits: int, bucket: int, stochastic: bool, seed: int,
    offset: int = 0,
) -> np.ndarray:  # fmt: skip
    """Encode through gpu.py's launch code into a buffer starting ``offset`` bytes in."""
    hdr = CodecHeader(bits, bucket, x.size, x.dtype, stochastic and bits != 32)
    big = np.full(offset + hdr.nbytes + 7, 0xAB, np.uint8)
    buf = big[offset : offset + hdr.nbytes]
    G.encode_with_runner(emu, x, hdr, seed, buf)
    assert np.all(big[:offset] == 0xAB) and np.all(big[offset + hdr.nbytes :] == 0xAB)
    return buf


def gpu_decode(emu: EmulatedRunner, buf: np.ndarray, out: np.ndarray, add: bool) -> np.ndarray:
    G.decode_with_runner(emu, buf, read_header(buf), out, add)
    return out


def make(n: int, dtype: np.dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-2, 2)).astype(dtype)
    if n > 40:
        x[rng.integers(0, n, 3)] = 0.0
        x[n // 2 : n // 2 + 20] = x[n // 2]  # a constant stretch
    if n > 3000:
        x[2500] = np.nan
    return x


F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
ALL = (F32, F16, BF16)
CASES = [
    # n, bits, bucket, dtypes: warp-per-bucket tiles, block-reduced big buckets, buckets
    # not % 8, short last tiles and buckets, tiny buckets, groups crossing buckets (the
    # emulation runs 256 threads per block, so the slow tiny-bucket cases take one dtype)
    (0, 4, 1024, ALL),
    (1, 1, 1024, ALL),
    (13, 3, 4, ALL),
    (300, 2, 1, (F32,)),
    (1601, 5, 3, (BF16,)),
    (5000, 4, 1024, ALL),
    (9000, 8, 512, (F16,)),
    (3000, 7, 100, (F32,)),
    (2500, 6, 2048, (BF16,)),
    (4099, 4, 1000, (F16,)),
    (600, 3, 7, (F32,)),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,bits,bucket,dtypes", CASES)
def test_emulated_kernels_match_reference(
    emu: EmulatedRunner, n: int, bits: int, bucket: int, dtypes: tuple[np.dtype, ...]
) -> None:
    for i, dtype in enumerate(dtypes):
        x = make(n, dtype, seed=n + bits)
        for stochastic in (False, True):
            offset = (n + i + int(stochastic)) % 4  # segments at unaligned addresses too
            buf = gpu_encode(emu, x, bits, bucket, stochastic, seed=99, offset=offset)
            want = reference.encode(x, bits, bucket, stochastic=stochastic, seed=99)
            assert np.array_equal(buf, want), (dtype, stochastic, np.flatnonzero(buf != want)[:8])
        # values not 16-byte aligned: the scalar loads instead of the vector loads
        shifted = np.empty(n + 1, dtype)[1:]
        shifted[...] = x
        if n:
            assert shifted.ctypes.data % 16
        want = reference.encode(x, bits, bucket)
        assert np.array_equal(gpu_encode(emu, shifted, bits, bucket, False, 0), want)
        for out_dtype in (np.float32, np.float16, BF16, np.float64):
            got = gpu_decode(emu, buf, np.full(n, 7, out_dtype), add=False)
            ref = reference.decode(buf, out=np.empty(n, out_dtype))
            assert np.array_equal(got.view(np.uint8), ref.view(np.uint8)), out_dtype
        acc = np.linspace(-1, 1, n, dtype=np.float32)
        ref_acc = acc.copy()
        gpu_decode(emu, buf, acc, add=True)
        reference.decode_add(buf, ref_acc)
        assert np.array_equal(acc.view(np.uint32), ref_acc.view(np.uint32))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_emulated_raw_segments(emu: EmulatedRunner, offset: int) -> None:
    for dtype in (np.dtype(np.float32), np.dtype(np.float16), BF16):
        del emu.launches[:]
        x = make(777, dtype, seed=offset)
        buf = gpu_encode(emu, x, 32, 64, stochastic=True, seed=0, offset=offset)
        assert np.array_equal(buf, reference.encode(x, 32, 64))
        assert buf.size == encoded_nbytes(777, 32, 64, dtype)
        for out_dtype in (np.float32, np.float16, BF16, np.float64):
            got = gpu_decode(emu, buf, np.zeros(777, out_dtype), add=False)
            ref = reference.decode(buf, out=np.empty(777, out_dtype))
            assert np.array_equal(got.view(np.uint8), ref.view(np.uint8))
        acc = np.ones(777, np.float32)
        gpu_decode(emu, buf, acc, add=True)
        assert np.array_equal(acc, np.float32(1) + x.astype(np.float32))
        # payloads at odd addresses take the byte-wise kernels (numpy data is 16-aligned)
        raw = {name[-1] for name, _, _ in emu.launches if name.startswith("cgx_raw")}
        assert raw == {"a" if offset % dtype.itemsize == 0 else "u"}


def at_alignment(x: np.ndarray, mod: int) -> np.ndarray:
    """A copy of ``x`` whose data starts ``mod`` bytes past a 16-byte boundary."""
    raw = np.empty(x.nbytes + 32, np.uint8)
    start = (-raw.ctypes.data) % 16 + mod
    y = raw[start : start + x.nbytes].view(x.dtype)
    y[...] = x
    assert y.ctypes.data % 16 == mod
    return y


def with_specials(x: np.ndarray, bucket: int) -> np.ndarray:
    """``x`` with a -0, an Inf in the last bucket and, in float32, a range that overflows
    in the one before; the other buckets stay finite."""
    x = x.copy()
    n = x.size
    last = (n - 1) // bucket * bucket
    x[n // 5] = -0.0
    if last >= bucket:
        x[last] = np.inf
    if last >= 2 * bucket and x.dtype == F32:
        x[last - 2], x[last - 1] = 3e38, -3e38
    return x


BF, F64 = BF16, np.dtype(np.float64)
# n, bits, bucket, dtype, input alignment (bytes past 16), output byte offset, stochastic,
# decoded dtype ("x": into the input itself), max_grid (the encode's min_blocks)
ENCODE_CASES = [
    (20000, 4, 1024, F32, 0, 0, False, None, 3),  # 16-byte loads, several tiles
    (20003, 4, 1024, F32, 4, 1, True, F32, 3),  # scalar loads, odd output, partial chunk
    (9001, 1, 512, F16, 2, 3, False, F16, 3),  # 2-byte aligned halves
    (9001, 2, 2048, BF, 8, 2, True, None, 3),  # 8-byte loads of bfloat16
    (5000, 3, 100, F32, 8, 0, False, BF, 3),  # chunks crossing buckets, 8-byte loads
    (5000, 5, 1000, F16, 4, 1, True, F32, 3),  # 4-byte loads of halves
    (20001, 6, 10000, F32, 0, 3, False, F64, 3),  # buckets over a tile: two rounds
    (20001, 7, 10000, F32, 12, 2, True, "x", 3),  # the same, decoded in place
    (9000, 8, 8193, BF, 0, 1, False, F16, 3),  # odd buckets over a tile, crossing
    (3001, 4, 3, F16, 6, 0, True, None, 3),  # tiny odd buckets, 512 a tile
    (700, 2, 1, F32, 12, 2, False, F32, 3),  # a bucket per value
    (1025, 8, 16, F32, 0, 0, False, None, 64),  # small tiles for many blocks
    (16384, 4, 8192, F16, 0, 3, True, "x", 3),  # a bucket exactly a tile
    (40, 5, 1024, BF, 2, 1, True, F32, 3),  # less than a warp of chunks
    (1, 3, 1024, F32, 4, 3, True, F16, 3),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ENCODE_CASES, ids=lambda c: "-".join(map(str, c[:4])))
def test_emulated_encode_paths_match_reference(
    emu: EmulatedRunner, monkeypatch: pytest.MonkeyPatch, case: tuple[Any, ...]
) -> None:
    n, bits, bucket, dtype, mod, offset, stochastic, ddt, max_grid = case
    monkeypatch.setattr(emu, "max_grid", max_grid)
    x = at_alignment(with_specials(make(n, dtype, seed=n + bits), bucket), mod)
    want = reference.encode(x, bits, bucket, stochastic=stochastic, seed=7)
    hdr = CodecHeader(bits, bucket, n, dtype, stochastic)
    big = np.full(offset + hdr.nbytes + 5, 0xAB, np.uint8)
    buf = big[offset : offset + hdr.nbytes]
    decoded = None if ddt is None else x if ddt == "x" else np.full(n, 5, ddt)
    del emu.launches[:]
    G.encode_with_runner(emu, x, hdr, 7, buf, decoded)
    assert [name for name, _, _ in emu.launches] == [f"cgx_encode_{G._DT_NAMES[dtype]}"]
    assert emu.launches[0][1] == G.encode_plan(hdr, max_grid)[0]
    assert np.all(big[:offset] == 0xAB) and np.all(big[offset + hdr.nbytes :] == 0xAB)
    bad = np.flatnonzero(buf != want)
    assert bad.size == 0, (bad[:8], buf[bad[:8]], want[bad[:8]])
    if decoded is not None:
        ref = reference.decode(want, out=np.empty(n, decoded.dtype))
        assert np.array_equal(decoded.view(np.uint8), ref.view(np.uint8))


def test_emulated_encode_plan_uses_small_tiles_for_small_inputs() -> None:
    hdr = CodecHeader(4, 1024, 4 << 20, np.dtype(np.float32))  # 16 MiB of float32
    assert G.encode_plan(hdr, 1056) == (1024, 4)  # 132 SMs x 8: 4096 values a block
    assert G.encode_plan(hdr) == (512, 8)  # else as many as a block holds (8192)
    assert G.encode_plan(CodecHeader(4, 1024, 64 << 20, hdr.dtype), 1056) == (8192, 8)
    assert G.encode_plan(CodecHeader(4, 3, 10**6, hdr.dtype), 10**6)[1] == 8  # code bytes


def piece_segments(total: int) -> list[tuple[int, int, int, int]]:
    """(start, stop, bits, bucket) of segments covering [0, total): every kind of segment."""
    cuts = [(0, 1000, 4, 1024), (1000, 1003, 32, 64), (1003, 5000, 2, 100), (5000, 5000, 4, 512),
            (5000, 17000, 3, 10000), (17000, 17005, 8, 1), (17005, 20005, 32, 8),
            (20005, 20006, 6, 1024), (20006, total, 5, 512)]  # fmt: skip
    assert cuts[-1][1] > cuts[-1][0]
    return cuts


def packed_reference(x: np.ndarray, segs: list, stochastic: bool) -> tuple[np.ndarray, list]:
    parts = [reference.encode(x[a:b], bits, bucket, stochastic=stochastic, seed=31 * a + 1)
             for a, b, bits, bucket in segs]  # fmt: skip
    return np.concatenate(parts), parts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stochastic", [False, True])
def test_emulated_batched_encode_is_one_launch_and_matches(
    emu: EmulatedRunner, monkeypatch: pytest.MonkeyPatch, stochastic: bool
) -> None:
    x = with_specials(make(24000, F32, seed=5), 512)
    x[3000:3010] = np.nan  # a non-finite bucket inside a segment
    segs = piece_segments(x.size)
    want, parts = packed_reference(x, segs, stochastic)
    dec = np.full(x.size, 9, BF16)
    items = [(x[a:b], CodecHeader(bits, bucket, b - a, F32, stochastic and bits != 32),
              31 * a + 1, None if bits == 32 or a % 2 else dec[a:b])
             for a, b, bits, bucket in segs]  # fmt: skip
    for offset, kernel_max in ((3, G.RAW_KERNEL_MAX), (0, 16)):  # RAW copied in the kernel, or not
        monkeypatch.setattr(G, "RAW_KERNEL_MAX", kernel_max)
        big = np.full(want.size + 8, 0xAB, np.uint8)
        buf = big[offset : offset + want.size]
        del emu.launches[:]
        assert G.encode_batch_with_runner(emu, items, buf) == want.size
        assert [name for name, _, _ in emu.launches] == ["cgx_encode_f32"]
        assert np.array_equal(buf, want) and np.all(big[:offset] == 0xAB)
        assert np.all(big[offset + want.size :] == 0xAB)
    for (a, b, bits, _), part in zip(segs, parts, strict=True):
        if bits != 32 and a % 2 == 0:
            ref = reference.decode(part, out=np.empty(b - a, BF16))
            assert np.array_equal(dec[a:b].view(np.uint16), ref.view(np.uint16)), (a, b)
    # compressed segments of two value dtypes: one launch each
    y = make(3000, F16, seed=2)
    mixed = [(x[:2000], CodecHeader(4, 512, 2000, F32), 0, None),
             (y, CodecHeader(3, 100, 3000, F16), 0, None),
             (y[:7], CodecHeader(32, 8, 7, F16), 0, None)]  # fmt: skip
    want = np.concatenate([reference.encode(x[:2000], 4, 512), reference.encode(y, 3, 100),
                           reference.encode(y[:7], 32, 8)])  # fmt: skip
    buf = np.zeros(want.size, np.uint8)
    del emu.launches[:]
    G.encode_batch_with_runner(emu, mixed, buf)
    assert sorted(name for name, _, _ in emu.launches) == ["cgx_encode_f16", "cgx_encode_f32"]
    assert np.array_equal(buf, want)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ALL, ids=lambda d: d.name)
def test_emulated_batched_decode_matches_and_checks_headers(
    emu: EmulatedRunner, dtype: np.dtype
) -> None:
    x = make(22000, dtype, seed=3)
    segs = piece_segments(x.size)
    packed, _ = packed_reference(x, segs, stochastic=True)  # the flag is not compared
    for offset in (0, 1):  # RAW payloads aligned to their element, or not
        big = np.zeros(packed.size + 1, np.uint8)
        buf = big[offset : offset + packed.size]
        buf[...] = packed
        for target in (np.float32, np.float16, BF16, np.float64, "add"):
            odt = np.dtype(np.float32 if target == "add" else target)
            out = np.linspace(-3, 3, x.size).astype(odt)
            ref = out.copy()
            pos = 0
            for a, b, bits, bucket in segs:
                seg = packed[pos : pos + encoded_nbytes(b - a, bits, bucket, dtype)]
                pos += seg.size
                if target == "add":
                    reference.decode_add(seg, ref[a:b])
                else:
                    reference.decode(seg, out=ref[a:b])
            items = [(CodecHeader(bits, bucket, b - a, dtype), out[a:b])
                     for a, b, bits, bucket in segs]  # fmt: skip
            del emu.launches[:]
            assert G.decode_batch_with_runner(emu, buf, items, add=target == "add")
            assert len(emu.launches) == 1 and emu.launches[0][0].endswith("_batch")
            assert np.array_equal(out.view(np.uint8), ref.view(np.uint8)), (offset, target)
    # a header that is not the expected one, or a wrong length: False, nothing written
    out = np.zeros(x.size, np.float32)
    items = [(CodecHeader(bits, bucket, b - a, dtype), out[a:b]) for a, b, bits, bucket in segs]
    bad = packed.copy()
    bad[encoded_nbytes(1000, 4, 1024, dtype) + 5] ^= 1  # the second segment's bits field
    assert not G.decode_batch_with_runner(emu, bad, items, add=True)
    assert not G.decode_batch_with_runner(emu, packed[:-1], items, add=True)
    assert not out.any()
    wrong = [(CodecHeader(h.bits, h.bucket_size + 1, h.numel, h.dtype), o) for h, o in items]
    assert not G.decode_batch_with_runner(emu, packed, wrong, add=True) and not out.any()


def make_piece(total: int) -> Piece:
    cuts = enumerate(piece_segments(total))
    return Piece(
        0, total, tuple(Segment(a, b, bits, bucket, i) for i, (a, b, bits, bucket) in cuts)
    )


def run_piece_ops(xp: Any, dtype: np.dtype, stochastic: bool) -> list[np.ndarray]:
    """Every piece operation of the collectives on one piece; what each wrote, on the host."""
    n = 21000
    piece = make_piece(n)
    x0 = make(n, dtype, seed=1)
    host = [x0]
    seeds = (5, 9, 1)  # seed, seq, rank
    x = xp.asarray(x0)
    acc = xp.asarray(np.linspace(-2, 2, n, dtype=np.float32))
    out = xp.zeros(piece.wire_nbytes(dtype) + 16, np.uint8)
    wire = encode_piece(x, 0, piece, out[3:], stochastic, *seeds)  # starts at an odd byte
    host.append(to_host(wire))
    decode_add_piece(wire, piece, acc, 0, dtype)
    host.append(to_host(acc))
    y = xp.zeros(n, dtype)
    decode_piece(wire, piece, y, 0, dtype)
    host.append(to_host(y))
    buf = xp.zeros(piece.wire_nbytes(np.float32), np.uint8)
    host.append(to_host(requantize_piece(acc, 0, piece, buf, x, stochastic, *seeds)))
    host += [to_host(x), to_host(acc)]
    out2 = xp.zeros(piece.wire_nbytes(np.float32), np.uint8)
    host.append(to_host(reduce_requantize_piece(wire, piece, acc, 0, x, 3, out2, stochastic,
                                                *seeds)))  # fmt: skip
    return [*host, to_host(x), to_host(acc)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype,stochastic", [(F32, True), (F16, False)], ids=["f32", "f16"])
def test_emulated_piece_codec_takes_one_launch_per_piece(
    emu: EmulatedRunner, monkeypatch: pytest.MonkeyPatch, dtype: np.dtype, stochastic: bool
) -> None:
    # the per-segment path through the NumPy reference...
    monkeypatch.setattr(codec, "_backend_for", lambda a, numel=None: codec._backend("numpy"))
    monkeypatch.setattr(piece_codec, "_gpu_batch", lambda a, piece: None)
    want = run_piece_ops(np, dtype, stochastic)
    # ... and the batched kernels (what CuPy arrays take), on the emulator
    monkeypatch.setattr(piece_codec, "_gpu_batch", lambda a, p: G if len(p.segments) > 1 else None)
    monkeypatch.setattr(G, "_runner", lambda a: emu)
    monkeypatch.setattr(G, "_device", lambda a: contextlib.nullcontext())
    del emu.launches[:]
    got = run_piece_ops(np, dtype, stochastic)
    kernels = [name for name, _, _ in emu.launches]
    assert kernels == [f"cgx_encode_{G._DT_NAMES[dtype]}", "cgx_decode_add_batch",
                       f"cgx_decode_{G._DT_NAMES[dtype]}_batch", "cgx_encode_f32",
                       "cgx_decode_add_batch", "cgx_encode_f32"]  # fmt: skip
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), i
    # a buffer that is not the piece's layout: nothing is decoded, the codec's error is raised
    piece = make_piece(21000)
    wire = np.zeros(piece.wire_nbytes(dtype), np.uint8)
    acc = np.ones(21000, np.float32)
    with pytest.raises(CodecError, match="magic"):
        decode_add_piece(wire, piece, acc, 0, dtype)
    assert np.all(acc == 1)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_piece_codec_matches_host(cp: Any) -> None:
    for dtype, stochastic in ((F32, True), (F16, False)):
        got = run_piece_ops(cp, dtype, stochastic)
        want = run_piece_ops(np, dtype, stochastic)  # the host codec, segment by segment
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (dtype, i)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_encode_paths_match_reference(cp: Any) -> None:
    """The ENCODE_CASES on the GPU: alignments, tails, rounds, decoded values (bytes)."""
    for n, bits, bucket, dtype, mod, offset, stochastic, ddt, _ in ENCODE_CASES:
        x = with_specials(make(n, dtype, seed=n + bits), bucket)
        want = reference.encode(x, bits, bucket, stochastic=stochastic, seed=7)
        k = 16 + mod // dtype.itemsize  # CuPy allocations are 256-byte aligned
        xd = cp.asarray(np.concatenate([np.zeros(k, dtype), x]))[k:]
        assert xd.data.ptr % 16 == mod
        out = cp.zeros(offset + want.size, cp.uint8)
        if ddt is None:
            got = encode(xd, bits, bucket, out=out[offset:], stochastic=stochastic, seed=7)
        else:
            dec = xd if ddt == "x" else cp.zeros(n, ddt)
            got = encode_decode(xd, bits, bucket, decoded=dec, out=out[offset:],
                                stochastic=stochastic, seed=7)  # fmt: skip
            ref = reference.decode(want, out=np.empty(n, dec.dtype))
            assert np.array_equal(to_host(dec).view(np.uint8), ref.view(np.uint8)), (n, bits)
        assert np.array_equal(to_host(got), want), (n, bits, bucket, dtype)


def test_fused_kernel_fields_match_the_source() -> None:
    src = (KERNEL_DIR / G.SOURCE).read_text()
    for struct, fields in (("cgx_enc_seg", G.ENC_FIELDS), ("cgx_dec_seg", G.DEC_FIELDS)):
        body = re.search(r"struct " + struct + r" \{(.*?)\};", src, re.S).group(1)
        names = []
        for decl in re.findall(r"cgx_[ui]64 ([^;]+);", body):
            names += [n.strip() for n in decl.split(",")]
        assert tuple(names) == fields, struct


def test_encode_plan_tiles_start_on_code_bytes() -> None:
    for bucket in (1, 3, 7, 8, 12, 100, 512, 1000, 1024, 4096, 10**6, 2**32 - 1):
        hdr = CodecHeader(4, bucket, 10**7, np.dtype(np.float32))
        grid, tile = G.encode_plan(hdr)
        assert 1 <= tile <= G.MAX_TILE_BUCKETS and (tile * bucket) % 8 == 0
        assert grid * tile >= hdr.nbuckets > (grid - 1) * tile


def test_typed_args_match_signatures() -> None:
    args = G.typed_args("cgx_decode_add", (1, 2, 3, 4, 5, 6))
    assert [a.dtype for a in args] == [np.uint64, np.int64, np.int64, np.int32, np.int64, np.uint64]
    with pytest.raises(AssertionError):
        G.typed_args("cgx_decode_add", (1, 2))


@pytest.mark.timeout(120)
def test_compiled_image_is_cached_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(G, "_cache_dir", lambda: tmp_path / "kernels")
    # a small source: the cache, not the kernels, is under test (they take seconds to build)
    small = 'extern "C" __global__ void cgx_k(int* p) { *p = 1; }'
    monkeypatch.setattr(G, "kernel_source", lambda: small)
    first = G._image("sm_90")
    files = list((tmp_path / "kernels").glob("quantize-sm_90-*.bin"))
    assert len(files) == 1 and files[0].read_bytes() == first
    monkeypatch.setattr(G, "compile_kernels", lambda *a: pytest.fail("not cached"))
    assert G._image("sm_90") == first
