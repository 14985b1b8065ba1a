"""Fuzzing the decoder: random and mutated bytes raise CodecError and nothing else.

A buffer from the network is validated (magic, version, bits, dtype, flags, bucket size,
reserved field, exact length) before anything is allocated or decoded; a buffer that
passes carries a consistent header, so decoding it cannot read out of bounds whatever
its payload bytes are.
"""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cgx_ucx.compression import decode, decode_add, encode, read_header, reference
from cgx_ucx.errors import CodecError

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEADER = struct.Struct("<4sBBBBIQI")


def valid_buffers() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for n, bits, bucket, dt in [
        (0, 4, 16, np.float32),
        (1, 1, 1, np.float16),
        (100, 3, 7, ml_dtypes.bfloat16),
        (257, 8, 64, np.float32),
        (33, 32, 8, np.float16),
        (40, 32, 8, np.float32),
    ]:
        out.append(encode(rng.standard_normal(n).astype(dt), bits, bucket))
    return out


VALID = valid_buffers()


def only_codec_errors(buf: bytes | np.ndarray) -> None:
    """Every entry point either succeeds consistently or raises CodecError."""
    arr = np.frombuffer(bytes(buf), np.uint8) if isinstance(buf, bytes | bytearray) else buf
    try:
        hdr = read_header(arr)
    except CodecError:
        for call in (
            lambda: decode(arr),
            lambda: reference.decode(arr),
            lambda: decode_add(arr, np.zeros(4, np.float32)),
        ):
            with pytest.raises(CodecError):
                call()
        return
    # a header that validates: decoding must work and give numel values
    y = decode(arr)
    assert y.shape == (hdr.numel,) and y.dtype == hdr.dtype
    yr = reference.decode(arr)
    assert np.array_equal(y.view(np.uint8), yr.view(np.uint8))
    acc = np.zeros(hdr.numel, np.float32)
    decode_add(arr, acc)
    with pytest.raises(CodecError):
        decode_add(arr, np.zeros(hdr.numel + 1, np.float32))


@pytest.mark.timeout(60)
@SETTINGS
@given(data=st.binary(max_size=200))
def test_random_bytes(data: bytes) -> None:
    only_codec_errors(data)


@pytest.mark.timeout(60)
@SETTINGS
@given(data=st.binary(min_size=0, max_size=64))
def test_random_bytes_behind_a_valid_magic(data: bytes) -> None:
    only_codec_errors(b"CGXQ\x01" + data)


@pytest.mark.timeout(60)
@SETTINGS
@given(
    which=st.integers(0, len(VALID) - 1),
    cut=st.integers(0, 10_000),
    extra=st.binary(min_size=1, max_size=16),
)
def test_truncated_and_extended(which: int, cut: int, extra: bytes) -> None:
    buf = VALID[which].tobytes()
    only_codec_errors(buf[: cut % len(buf)])  # strictly shorter
    only_codec_errors(buf + extra)


@pytest.mark.timeout(60)
@SETTINGS
@given(
    which=st.integers(0, len(VALID) - 1),
    field=st.sampled_from(["version", "bits", "dtype", "flags", "bucket", "numel", "reserved"]),
    value=st.one_of(
        st.integers(0, 255),
        st.sampled_from([2**31, 2**32 - 1, 2**62, 2**63, 2**64 - 1, 2**40 + 3]),
    ),
)
def test_header_fields_mutated(which: int, field: str, value: int) -> None:
    buf = bytearray(VALID[which].tobytes())
    fields = dict(
        zip(
            ["magic", "version", "bits", "dtype", "flags", "bucket", "numel", "reserved"],
            HEADER.unpack(bytes(buf[:24])),
            strict=True,
        )
    )
    limits = {"bucket": 2**32 - 1, "numel": 2**64 - 1, "reserved": 2**32 - 1}
    fields[field] = value % (limits.get(field, 255) + 1)
    buf[:24] = HEADER.pack(*fields.values())
    only_codec_errors(bytes(buf))


@pytest.mark.timeout(60)
@SETTINGS
@given(which=st.integers(0, len(VALID) - 1), data=st.data())
def test_random_byte_flips(which: int, data: st.DataObject) -> None:
    buf = bytearray(VALID[which].tobytes())
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    only_codec_errors(bytes(buf))


def test_huge_numel_is_rejected_before_allocation() -> None:
    # numel = 2**63 claims 32 EiB: refused by the length check, nothing is allocated
    hdr = HEADER.pack(b"CGXQ", 1, 4, 0, 0, 1024, 2**63, 0)
    for payload in (b"", b"\0" * 1000):
        with pytest.raises(CodecError, match="truncated"):
            decode(np.frombuffer(hdr + payload, np.uint8))


def test_non_buffers_and_wrong_arrays() -> None:
    for bad in (None, 3, "CGXQ", np.zeros(30, np.float32), np.zeros((30, 1), np.uint8)):
        with pytest.raises(CodecError):
            decode(bad)
        with pytest.raises(CodecError):
            read_header(bad)
