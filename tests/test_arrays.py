"""cgx_ucx.arrays: array kinds, torch duck typing, byte buffers and the shared validators."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from _gpu import usable_cupy

from cgx_ucx import arrays
from cgx_ucx.arrays import (
    BFLOAT16,
    CODEC_DTYPES,
    NO_COMPRESSION_BITS,
    VALID_BITS,
    as_uint8_buffer,
    check_bits,
    check_positive_int,
    check_seed,
    is_array,
    is_bfloat16,
    is_cupy,
    is_float_dtype,
    is_torch,
    to_host,
    torch_as_array,
    xp_of,
)
from cgx_ucx.errors import CGXError, CodecError, ConfigError


def _object_from(module: str) -> object:
    """An instance of a class whose ``__module__`` is ``module`` (kind is judged by it)."""
    return type("Fake", (), {"__module__": module})()


# -- constants --------------------------------------------------------------------------


def test_constants():
    assert np.dtype(ml_dtypes.bfloat16) == BFLOAT16
    assert {np.dtype(np.float32), np.dtype(np.float16), BFLOAT16} == CODEC_DTYPES
    assert np.dtype(np.float64) not in CODEC_DTYPES
    assert NO_COMPRESSION_BITS == 32
    assert sorted(VALID_BITS) == [1, 2, 3, 4, 5, 6, 7, 8, 32]


def test_module_sits_at_the_bottom():
    """arrays imports nothing of cgx_ucx but errors, and no CUDA/torch library at top level."""
    tree = ast.parse(Path(arrays.__file__).read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            top.add("." * node.level + (node.module or ""))
    assert top == {"__future__", "sys", "typing", "ml_dtypes", "numpy", ".errors"}


def test_import_never_needs_cupy():
    code = "import sys, cgx_ucx.arrays; sys.exit('cupy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


# -- kinds ------------------------------------------------------------------------------


def test_kinds_of_host_values():
    x = np.zeros(3, np.float32)
    assert not is_cupy(x) and is_array(x) and not is_torch(x)
    assert xp_of(x) is np
    for other in ([1.0], b"ab", 3, None):
        assert not is_cupy(other) and not is_array(other)
        assert xp_of(other) is np
    t = torch.zeros(2)
    assert is_torch(t) and not is_array(t) and not is_cupy(t)
    assert is_torch(torch.nn.Parameter(torch.zeros(2)))


def test_cupy_is_judged_by_top_level_module(monkeypatch):
    assert is_cupy(_object_from("cupy"))
    assert is_cupy(_object_from("cupy._core.core"))
    assert not is_cupy(_object_from("cupyx.scipy.sparse"))
    assert not is_cupy(_object_from("notcupy"))
    fake = _object_from("cupy._core.core")
    assert is_array(fake)
    # xp_of looks CuPy up among the loaded modules (a CuPy array implies it is loaded)
    sentinel = type(sys)("cupy")
    monkeypatch.setitem(sys.modules, "cupy", sentinel)
    assert xp_of(fake) is sentinel


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (BFLOAT16, True),
        (ml_dtypes.bfloat16, True),
        ("bfloat16", True),
        (torch.bfloat16, True),
        (np.float16, False),
        (np.dtype(np.float32), False),
        ("float32", False),
        (torch.float16, False),
        (object(), False),
    ],
)
def test_is_bfloat16(dtype, expected):
    assert is_bfloat16(dtype) is expected


def test_is_float_dtype():
    for dt in (np.float16, np.float32, np.float64, BFLOAT16):
        assert is_float_dtype(np.dtype(dt)), dt
    for dt in (np.int16, np.uint8, np.complex64, np.bool_):
        assert not is_float_dtype(np.dtype(dt)), dt


# -- torch tensors ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_torch_as_array_shares_memory(dtype):
    t = torch.arange(6, dtype=dtype)
    a = torch_as_array(t)
    assert isinstance(a, np.ndarray) and a.shape == (6,)
    assert np.array_equal(a, np.arange(6))
    a[0] = 5
    assert t[0].item() == 5


def test_torch_as_array_bfloat16_keeps_bytes():
    t = torch.tensor([1.5, -2.0, 3.0e38, 0.0], dtype=torch.bfloat16)
    a = torch_as_array(t)
    assert a.dtype == BFLOAT16
    assert np.array_equal(a.astype(np.float32), t.float().numpy())
    assert a.view(np.int16).tolist() == t.view(torch.int16).tolist()
    a[3] = 7
    assert t[3].item() == 7.0


def test_torch_as_array_detaches():
    t = torch.ones(3, requires_grad=True)
    a = torch_as_array(t)
    assert np.array_equal(a, np.ones(3, np.float32))


def test_torch_as_array_cuda():
    cupy = usable_cupy()
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    t = torch.arange(4, dtype=torch.float32, device="cuda")
    a = torch_as_array(t)
    assert is_cupy(a) and xp_of(a) is cupy
    a[1] = 9
    assert t[1].item() == 9.0


# -- host copies and byte buffers -------------------------------------------------------


def test_to_host():
    x = np.arange(4, dtype=np.float32)
    assert to_host(x) is x
    c = to_host(x, copy=True)
    assert c is not x and c.dtype == x.dtype and np.array_equal(c, x)
    c[0] = 9
    assert x[0] == 0
    assert np.array_equal(to_host([1, 2]), np.array([1, 2]))


def test_to_host_from_gpu():
    cupy = usable_cupy()
    g = cupy.arange(4, dtype=cupy.float32)
    h = to_host(g)
    assert isinstance(h, np.ndarray) and np.array_equal(h, np.arange(4, dtype=np.float32))


def test_as_uint8_buffer_accepts():
    a = np.arange(5, dtype=np.uint8)
    assert as_uint8_buffer(a) is a
    b = bytearray(b"\x01\x02\x03")
    v = as_uint8_buffer(b)
    assert v.dtype == np.uint8 and v.tolist() == [1, 2, 3]
    b[0] = 7
    assert v[0] == 7  # a view, not a copy
    assert as_uint8_buffer(b"xyz").tolist() == list(b"xyz")
    wide = memoryview(np.arange(2, dtype=np.uint32))
    assert as_uint8_buffer(wide).shape == (8,)  # bytes of any buffer


def test_as_uint8_buffer_refuses():
    with pytest.raises(CodecError, match=r"an encoded buffer is a 1-D uint8 array.*float32"):
        as_uint8_buffer(np.zeros(4, np.float32))
    with pytest.raises(CodecError, match=r"\(2, 2\)"):
        as_uint8_buffer(np.zeros((2, 2), np.uint8))
    with pytest.raises(CodecError, match="contiguous"):
        as_uint8_buffer(np.zeros(8, np.uint8)[::2])
    with pytest.raises(CodecError, match="not a buffer: list"):
        as_uint8_buffer([1, 2])
    with pytest.raises(CodecError, match=r"^payload is"):
        as_uint8_buffer(np.zeros(2, np.int8), what="payload")


# -- validators -------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [*range(1, 9), 32, np.int8(4), np.uint64(32)])
def test_check_bits_accepts(bits):
    out = check_bits(bits)
    assert type(out) is int and out == int(bits)


@pytest.mark.parametrize("bits", [0, 9, 16, 31, 33, -1, True, False, 4.0, "4", None])
def test_check_bits_refuses(bits):
    with pytest.raises(ConfigError, match=r"^bits_max must be .*1\.\.8 or 32") as info:
        check_bits(bits, "bits_max")
    assert repr(bits) in str(info.value) or str(bits) in str(info.value)


def test_check_seed():
    assert check_seed(0) == 0
    top = check_seed(np.uint64(2**64 - 1))
    assert type(top) is int and top == 2**64 - 1
    for bad in (-1, 2**64, True, 1.0, "1", None):
        with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
            check_seed(bad)
    with pytest.raises(ConfigError, match=r"^CGX seed .*got -5"):
        check_seed(-5, "CGX seed")


def test_check_positive_int():
    assert check_positive_int(1, "n") == 1
    assert check_positive_int(0, "n", 0) == 0
    out = check_positive_int(np.int32(7), "n")
    assert type(out) is int and out == 7
    with pytest.raises(ConfigError, match=r"^bucket size must be an integer >= 1, got 0$"):
        check_positive_int(0, "bucket size")
    with pytest.raises(ConfigError, match=r">= 2, got 1"):
        check_positive_int(1, "n", 2)
    for bad in (True, 2.0, "3", None):
        with pytest.raises(ConfigError):
            check_positive_int(bad, "n")
    assert check_positive_int(2**32 - 1, "bucket_size", limit=2**32) == 2**32 - 1
    with pytest.raises(ConfigError, match=r"in \[1, 4294967296\), got 4294967296"):
        check_positive_int(2**32, "bucket_size", limit=2**32)


def test_check_positive_int_error_type():
    with pytest.raises(CodecError, match="numel must be an integer >= 0, got -1") as info:
        check_positive_int(-1, "numel", 0, error=CodecError)
    assert not isinstance(info.value, ConfigError)
    assert isinstance(info.value, CGXError) and isinstance(info.value, ValueError)
