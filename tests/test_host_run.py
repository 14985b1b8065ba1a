"""HostRun (the mailbox allreduce's codec): the same bytes and the same sums as
the generic per-segment path (encode_piece / decode_add_piece) for every dtype, mixed
layouts with uncompressed layers, both roundings, unaligned and read-only buffers; and
the same CodecError for bytes that are not a run of its layout."""

from __future__ import annotations

import numpy as np
import pytest

from cgx_ucx.arrays import BFLOAT16
from cgx_ucx.collectives.local import host_run
from cgx_ucx.collectives.piece_codec import decode_add_piece, encode_piece, mix_seed
from cgx_ucx.collectives.plan import make_plan
from cgx_ucx.collectives.reduction import AllreduceSpec, encode_one_round
from cgx_ucx.config import CompressionConfig
from cgx_ucx.errors import CodecError
from cgx_ucx.layout import Layout

SEQ, RANK, SEED = 7, 1, 5


def one_piece_spec(sizes: list[int], bits: int, stochastic: bool) -> AllreduceSpec:
    cfg = CompressionConfig(bits=bits, bucket_size=512, minimal_size=8)
    lay = Layout.from_sizes(sizes, cfg)
    plan = make_plan(lay, 1, max(lay.numel, 1), 1)
    return AllreduceSpec(
        plan=plan, raw=False, avg=False, acc_dtype=np.dtype(np.float32), inplace=True,
        stochastic=stochastic, seed=SEED,
    )  # fmt: skip


def reference(spec: AllreduceSpec, x: np.ndarray) -> np.ndarray:
    piece = spec.plan.chunks[0].pieces[0]
    out = np.zeros(piece.wire_nbytes(x.dtype), np.uint8)
    return encode_piece(x, 0, piece, out, spec.stochastic, SEED, SEQ, RANK).copy()


def seeds(spec: AllreduceSpec) -> list[int]:
    segs = spec.plan.chunks[0].pieces[0].segments
    return [mix_seed(SEED, SEQ, RANK, s.layer, s.start) for s in segs] if spec.stochastic else []


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16], ids=str)
@pytest.mark.parametrize("sizes", [[1024], [3, 1000, 5001], [1, 7, 9, 2048, 33], [70000]])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_same_bytes_and_sums_as_the_generic_path(dtype, sizes, stochastic, bits):
    spec = one_piece_spec(sizes, bits, stochastic)
    numel = sum(sizes)
    rng = np.random.default_rng(numel + bits)
    x = (rng.standard_normal(numel) * 3).astype(dtype)
    ref = reference(spec, x)
    run = host_run(spec, x.dtype)
    assert run is host_run(spec, x.dtype)  # built once per spec
    assert run.nbytes == ref.size
    for shift in (0, 1, 3):  # aligned, and segments that start off a float32 boundary
        out = np.full(ref.size + 16 + shift, 0xAA, np.uint8)[shift:]
        got = run.encode(x, out, seeds(spec))
        assert got.tobytes() == ref.tobytes()
        assert (out[ref.size :] == 0xAA).all()  # nothing written past the run
    piece = spec.plan.chunks[0].pieces[0]
    for shift in (0, 1):
        frozen = np.zeros(ref.size + shift, np.uint8)[shift:]
        frozen[...] = ref
        frozen.flags.writeable = False  # a peer's mapped mailbox
        start = rng.standard_normal(numel).astype(np.float32)
        want, got_acc = start.copy(), start.copy()
        decode_add_piece(ref, piece, want, 0, x.dtype)
        run.decode_add(frozen, got_acc)
        assert got_acc.tobytes() == want.tobytes()


def test_bytes_not_of_the_layout_are_codec_errors_and_leave_acc_alone():
    spec = one_piece_spec([1000, 3000], 4, False)
    x = np.linspace(-1, 1, 4000, dtype=np.float32)
    good = reference(spec, x)
    run = host_run(spec, x.dtype)
    acc = np.ones(4000, np.float32)
    for bad in (good[:-1], np.concatenate([good, good[:1]])):
        with pytest.raises(CodecError, match=r"truncated|oversized"):
            run.decode_add(bad, acc)
    corrupt = good.copy()
    corrupt[0] ^= 0xFF  # the first segment's magic
    with pytest.raises(CodecError, match="magic"):
        run.decode_add(corrupt, acc)
    assert (acc == 1).all()
    small = np.zeros(run.nbytes - 1, np.uint8)
    with pytest.raises(CodecError, match="needs"):
        run.encode(x, small)


def test_an_uncompressed_segment_with_a_wrong_header_is_a_codec_error():
    spec = one_piece_spec([5, 4000], 4, False)  # 5 values: under minimal_size, raw
    x = np.linspace(-1, 1, 4005, dtype=np.float32)
    good = reference(spec, x)
    run = host_run(spec, x.dtype)
    acc = np.ones(4005, np.float32)
    for byte in (0, 5):  # its magic, its bit width
        corrupt = good.copy()
        corrupt[byte] ^= 0x40
        with pytest.raises(CodecError):
            run.decode_add(corrupt, acc)
        assert (acc == 1).all()
    run.decode_add(good, acc)
    assert np.array_equal(acc[:5], x[:5] + 1)


def test_buffers_of_another_kind_are_codec_errors_not_wrong_sums():
    """Bytes-like runs decode to the same sums as the array; a run that is not contiguous
    uint8 (an int8 view, a strided one), a wrong accumulator or output, and a wrong input
    dtype are CodecErrors that leave the accumulator untouched."""
    spec = one_piece_spec([1000], 4, False)
    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    good = reference(spec, x)
    run = host_run(spec, x.dtype)
    want = np.zeros(1000, np.float32)
    run.decode_add(good, want)
    for ok in (good.tobytes(), bytearray(good.tobytes()), memoryview(good.tobytes())):
        got = np.zeros(1000, np.float32)
        run.decode_add(ok, got)
        assert got.tobytes() == want.tobytes()
    acc = np.zeros(1000, np.float32)
    wide = np.repeat(good, 2)
    for bad, match in ((good.view(np.int8), "uint8"), (wide[::2], "contiguous")):
        with pytest.raises(CodecError, match=match):
            run.decode_add(bad, acc)
    for bad_acc in (
        np.zeros(999, np.float32),
        np.zeros(1000, np.float64),
        np.zeros((2, 500), np.float32),
    ):
        with pytest.raises(CodecError, match="acc"):
            run.decode_add(good, bad_acc)
    assert (acc == 0).all()
    out = np.zeros(run.nbytes, np.uint8)
    with pytest.raises(CodecError, match="uint8"):
        run.encode(x, out.view(np.int8))
    with pytest.raises(CodecError, match="contiguous"):
        run.encode(x, np.zeros(2 * run.nbytes, np.uint8)[::2])
    with pytest.raises(CodecError, match="x must"):
        run.encode(x.astype(np.float16), out)


@pytest.mark.parametrize("stochastic", [False, True])
def test_encode_one_round_seeds_every_segment_as_encode_piece(stochastic):
    """The one-round paths (mailboxes, messages) encode through encode_one_round: the same
    bytes as the generic encode_piece with that call's sequence number and rank."""
    spec = one_piece_spec([3, 1000, 17, 5001], 4, stochastic)
    x = np.random.default_rng(3).standard_normal(6021).astype(np.float32)
    out = np.zeros(host_run(spec, x.dtype).nbytes, np.uint8)
    assert encode_one_round(spec, x, out, SEQ, RANK).tobytes() == reference(spec, x).tobytes()
    other = encode_one_round(spec, x, out.copy(), SEQ + 1, RANK).tobytes()
    assert (other != reference(spec, x).tobytes()) == stochastic  # the seed moves with seq
