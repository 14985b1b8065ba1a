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

import ctypes
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from cgx_ucx.compression import encoded_nbytes, read_header, reference
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
#include <barrier>
#include <cstring>
#include <math.h>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

struct dim3 { unsigned int x = 1, y = 1, z = 1; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static  /* blocks run one at a time */

static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }

static std::barrier<>* emu_block_barrier;
static std::barrier<>* emu_warp_barrier[32];
static unsigned long long emu_shfl[32][2][32];
static thread_local int emu_phase;
static inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
// double-buffered: a lane cannot overwrite a slot before every lane has read it
template <class T> static T __shfl_xor_sync(unsigned, T v, int m) {
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long u = 0;
  std::memcpy(&u, &v, sizeof(T));
  emu_shfl[warp][emu_phase][lane] = u;
  emu_warp_barrier[warp]->arrive_and_wait();
  u = emu_shfl[warp][emu_phase][lane ^ m];
  emu_phase ^= 1;
  T r;
  std::memcpy(&r, &u, sizeof(T));
  return r;
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

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.launches: list[tuple[str, int, int]] = []

    def launch(self, name: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        sig = G.SIGNATURES[G.KERNELS[name]]
        assert block % 32 == 0 and block <= G.BLOCK and grid >= 1
        fn = getattr(self.lib, f"emu_{name}")
        fn.argtypes = [ctypes.c_uint, ctypes.c_uint] + [_CTYPES_PY[c] for c in sig]
        fn.restype = None
        self.launches.append((name, grid, block))
        fn(grid, block, *(int(a) for a in args))

    def ptr(self, a: np.ndarray) -> int:
        return int(a.ctypes.data)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)


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
    cmd = [gxx, *flags, "-o", str(lib), str(d / "driver.cpp")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-4000:]
    return EmulatedRunner(ctypes.CDLL(str(lib)))


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
    first = G._image("sm_90")
    files = list((tmp_path / "kernels").glob("quantize-sm_90-*.bin"))
    assert len(files) == 1 and files[0].read_bytes() == first
    monkeypatch.setattr(G, "compile_kernels", lambda *a: pytest.fail("not cached"))
    assert G._image("sm_90") == first
