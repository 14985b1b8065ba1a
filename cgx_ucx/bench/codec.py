"""Codec throughput on the host: Numba kernels and the NumPy reference next to memcpy.

``python -m cgx_ucx.bench codec [--sizes MiB ...] [--bits ...] [--repeat N] [--out-dir DIR]``

For each size (MiB of float32 input) and bit width it times, in the same run and on the
same buffers: ``np.copyto`` of the input (memcpy; its GB/s are bytes read per second),
``encode`` (round to nearest and stochastic), ``decode_add`` and the owner's requantization
(``encode_decode`` in place, one pass, next to the ``encode`` then ``decode`` it replaces;
``reduce_encode``, which also adds the last peer's piece and averages, next to
``decode_add``, divide, ``encode``, ``decode``)
with the Numba backend, and ``encode``/``decode_add`` with the NumPy reference. Every
figure is GB/s of float32 input (bytes of the float32 values / median time after
warm-up), with ratios to memcpy and to
the reference; the best times are kept too. The load average before and after is
recorded: on a shared machine the parallel kernels wait for every thread, so other
processes show up directly (compare the best times, or run with ``--threads 1``).

Shows a progress bar, prints a table and writes ``codec.json`` to ``--out-dir`` (default: a
new ``./cgx_bench_results/<timestamp>/``; ``--refresh-tracked``: the checkout's
``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from ..compression import (
    decode,
    decode_add,
    encode,
    encode_decode,
    encoded_nbytes,
    reduce_encode,
    reference,
)
from .report import (
    HelpFormatter,
    Progress,
    add_output_args,
    bits_arg,
    check_memory,
    count_arg,
    format_table,
    positive_number,
    results_dir,
    threads_arg,
    write_json,
)

MIB = 1 << 20
#: The reference is 50-100x slower: it gets at most this many timed repeats.
REFERENCE_REPEAT = 3
#: Buffers of a size held at once, in units of its float32 input: input, copy, accumulator,
#: requantized copy (4) and the codes and temporaries (about 1 more).
BUFFERS_PER_SIZE = 5


_BEST: dict[int, float] = {}  # id(fn) -> best time of the last _median_time call


def _median_time(fn: Callable[[], Any], repeat: int, warmup: int = 2) -> float:
    """Median wall time of ``repeat`` calls after ``warmup``; the best is kept in _BEST."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    _BEST[id(fn)] = min(times)
    return statistics.median(times)


def _timed(fn: Callable[[], Any], repeat: int, warmup: int = 2) -> tuple[float, float]:
    """(median, best) seconds."""
    med = _median_time(fn, repeat, warmup)
    return med, _BEST.pop(id(fn))


def _encode_then_decode(y: np.ndarray, bits: int, bucket: int, out: np.ndarray) -> None:
    decode(encode(y, bits, bucket, out=out), out=y)


def _reduce_then_requantize(
    peer: np.ndarray, y: np.ndarray, bits: int, bucket: int, out: np.ndarray
) -> None:
    decode_add(peer, y)
    np.divide(y, 2, out=y)
    _encode_then_decode(y, bits, bucket, out)


def run(
    sizes_mib: list[float],
    bits_list: list[int],
    bucket: int,
    repeat: int,
    with_reference: bool,
    bar: Progress | None = None,
) -> list[dict[str, Any]]:
    rows = []
    rng = np.random.default_rng(0)
    for mib in sizes_mib:
        n = int(mib * MIB) // 4
        x = rng.standard_normal(n).astype(np.float32)
        dst = np.empty_like(x)
        acc = np.zeros(n, np.float32)
        t_copy, b_copy = _timed(partial(np.copyto, dst, x), repeat)
        for bits in bits_list:
            out = np.empty(encoded_nbytes(n, bits, bucket), np.uint8)
            t_enc, b_enc = _timed(partial(encode, x, bits, bucket, out=out), repeat)
            t_sr = _median_time(
                partial(encode, x, bits, bucket, out=out, stochastic=True, seed=1), repeat
            )
            t_add, b_add = _timed(partial(decode_add, out, acc), repeat)
            y = x.copy()  # requantized in place, over and over: every pass does full work
            t_req = _median_time(
                partial(encode_decode, y, bits, bucket, out=out, decoded=y), repeat
            )
            t_two = _median_time(partial(_encode_then_decode, y, bits, bucket, out), repeat)
            peer = encode(x, bits, bucket)  # the last peer's piece, added before requantizing
            t_red = _median_time(
                partial(reduce_encode, peer, y, bits, bucket, decoded=y, divisor=2, out=out),
                repeat,
            )
            t_three = _median_time(
                partial(_reduce_then_requantize, peer, y, bits, bucket, out), repeat
            )
            row: dict[str, Any] = {"MiB": mib, "numel": n, "bits": bits}
            row["memcpy_GBps"] = x.nbytes / t_copy / 1e9
            row["memcpy_best_GBps"] = x.nbytes / b_copy / 1e9
            row["encode_best_GBps"] = x.nbytes / b_enc / 1e9
            row["decode_add_best_GBps"] = x.nbytes / b_add / 1e9
            row["encode_GBps"] = x.nbytes / t_enc / 1e9
            row["encode_sr_GBps"] = x.nbytes / t_sr / 1e9
            row["decode_add_GBps"] = x.nbytes / t_add / 1e9
            row["requantize_GBps"] = x.nbytes / t_req / 1e9
            row["encode_then_decode_GBps"] = x.nbytes / t_two / 1e9
            row["reduce_requantize_GBps"] = x.nbytes / t_red / 1e9
            row["decode_add_encode_decode_GBps"] = x.nbytes / t_three / 1e9
            row["encode_vs_memcpy"] = t_copy / t_enc
            row["decode_add_vs_memcpy"] = t_copy / t_add
            if with_reference:
                r = min(repeat, REFERENCE_REPEAT)
                t_ref_enc = _median_time(partial(reference.encode, x, bits, bucket), r, 1)
                t_ref_add = _median_time(partial(reference.decode_add, out, acc), r, 1)
                row["ref_encode_GBps"] = x.nbytes / t_ref_enc / 1e9
                row["ref_decode_add_GBps"] = x.nbytes / t_ref_add / 1e9
                row["encode_vs_ref"] = t_ref_enc / t_enc
                row["decode_add_vs_ref"] = t_ref_add / t_add
            rows.append(row)
            if bar is not None:
                bar.update(note=f"{mib:g} MiB {bits}-bit: encode {row['encode_GBps']:.2f} GB/s")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cgx_ucx.bench codec",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    ap.add_argument(
        "--sizes", type=positive_number, nargs="+", default=[1, 16, 64], help="MiB of float32"
    )
    ap.add_argument("--bits", type=bits_arg, nargs="+", default=[2, 4, 8], help="bit widths")
    ap.add_argument("--bucket", type=count_arg(1), default=1024, help="bucket size (values)")
    ap.add_argument("--repeat", type=count_arg(1), default=10, help="timed repeats (median)")
    ap.add_argument(
        "--threads", type=threads_arg, default=None, help="codec threads (unset: all cores)"
    )
    ap.add_argument("--no-reference", action="store_true", help="skip the NumPy reference")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    add_output_args(ap)
    args = ap.parse_args(argv)
    largest = max(args.sizes)
    check_memory(
        ap,
        "--sizes",
        BUFFERS_PER_SIZE * largest * MIB,
        f"{largest:g} MiB: {BUFFERS_PER_SIZE} buffers of that size (input, copy, accumulator, "
        "requantized copy, codes)",
    )
    out_dir = results_dir(args)

    from ..compression import cpu

    if args.threads:
        cpu.set_num_threads(args.threads)
    threads = cpu.num_threads()
    load_before = os.getloadavg()
    # compile (or load from the cache) before any timing
    if not args.quiet:
        print("codec: compiling the Numba kernels (cached after the first run)", file=sys.stderr)
    encode(np.zeros(1 << 17, np.float32), 4, args.bucket)
    with Progress(len(args.sizes) * len(args.bits), "codec", disable=args.quiet) as bar:
        rows = run(args.sizes, args.bits, args.bucket, args.repeat, not args.no_reference, bar)
    load_after = os.getloadavg()

    headers = ["MiB", "bits", "memcpy", "enc", "enc/memcpy", "enc best", "enc SR", "dec_add",
               "add/memcpy", "requant", "enc+dec", "red+req", "add+enc+dec"]  # fmt: skip
    if not args.no_reference:
        headers += ["ref enc", "enc/ref", "ref add", "add/ref"]
    table = []
    for r in rows:
        line = [r["MiB"], r["bits"], r["memcpy_GBps"], r["encode_GBps"], r["encode_vs_memcpy"],
                r["encode_best_GBps"], r["encode_sr_GBps"], r["decode_add_GBps"],
                r["decode_add_vs_memcpy"], r["requantize_GBps"],
                r["encode_then_decode_GBps"], r["reduce_requantize_GBps"],
                r["decode_add_encode_decode_GBps"]]  # fmt: skip
        if not args.no_reference:
            line += [r["ref_encode_GBps"], r["encode_vs_ref"], r["ref_decode_add_GBps"],
                     r["decode_add_vs_ref"]]  # fmt: skip
        table.append(line)
    print(f"codec throughput, GB/s of float32 input; bucket {args.bucket}; codec threads "
          f"{threads}; load average {load_before[0]:.2f} -> {load_after[0]:.2f}")  # fmt: skip
    print(format_table(headers, table))
    path = write_json(
        "codec",
        {
            "units": "GB/s of float32 input (memcpy: bytes read per second, np.copyto)",
            "bucket_size": args.bucket,
            "repeat": args.repeat,
            "codec_threads": threads,
            "loadavg_before": load_before,
            "loadavg_after": load_after,
            "rows": rows,
        },
        out_dir,
    )
    print(f"wrote {path}")
    return 0
