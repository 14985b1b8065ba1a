"""GPU codec check, run by ``benchmarks/gpu_check.sh`` on a machine with a CUDA GPU.

1. Correctness: GPU codes (round-to-nearest and stochastic) and decodes against the CPU
   (Numba) backend on random data of several sizes, bit widths and dtypes: bytes must be
   identical.
2. Throughput: encode, decode and decode_add of float32 input on the GPU, next to a
   device-to-device copy of the same input bytes measured in the same run (CUDA events,
   median of ``--repeat`` after warm-up). GB/s are bytes of float32 input per second; the
   copy's GB/s is the bytes copied per second (it reads and writes them).

Prints a table and writes ``gpu_codec.json`` (with its provenance) under ``--out`` (default:
``benchmarks/results/<machine class>/`` of this checkout, e.g. ``h200-16core/``).
Exit status 1 when any GPU bytes differ from the CPU's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from cgx_ucx.bench.provenance import machine_class  # noqa: E402
from cgx_ucx.bench.report import format_table, write_json  # noqa: E402
from cgx_ucx.compression import decode, decode_add, encode, encoded_nbytes  # noqa: E402

MIB = 1 << 20


def check_codes(cp: Any) -> list[dict[str, Any]]:
    """GPU bytes == CPU bytes for several sizes, bits, dtypes, rounding modes."""
    rows = []
    rng = np.random.default_rng(0)
    for n, bucket in [(1000, 7), (100_003, 512), (1_000_003, 1024), ((1 << 22) + 5, 1024)]:
        for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
            x = (rng.standard_normal(n) * 3).astype(dtype)
            xd = cp.asarray(x)
            for bits in range(1, 9):
                for stochastic in (False, True):
                    g = encode(xd, bits, bucket, stochastic=stochastic, seed=bits).get()
                    c = encode(x, bits, bucket, stochastic=stochastic, seed=bits)
                    ok = bool(np.array_equal(g, c))
                    if ok:
                        yd = decode(cp.asarray(c)).get()
                        ok = bool(np.array_equal(yd.view(np.uint8), decode(c).view(np.uint8)))
                    case = {"numel": n, "bucket": bucket, "dtype": np.dtype(dtype).name}
                    case |= {"bits": bits, "stochastic": stochastic, "identical": ok}
                    rows.append(case)
    return rows


def timer(cp: Any, repeat: int) -> Callable[[Callable[[], Any]], float]:
    def run(fn: Callable[[], Any]) -> float:
        for _ in range(3):  # warm-up: NVRTC compile, allocator
            fn()
        cp.cuda.get_current_stream().synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(repeat):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
        return statistics.median(times)

    return run


def throughput(cp: Any, sizes_mib: list[float], bits_list: list[int], bucket: int,
               repeat: int) -> list[dict[str, Any]]:  # fmt: skip
    run = timer(cp, repeat)
    rt = cp.cuda.runtime
    rows = []
    for mib in sizes_mib:
        n = int(mib * MIB) // 4
        x = cp.random.standard_normal(n, dtype=cp.float32)
        dst = cp.empty_like(x)
        acc = cp.zeros(n, cp.float32)
        sptr = cp.cuda.get_current_stream().ptr
        t_copy = run(
            partial(
                rt.memcpyAsync, dst.data.ptr, x.data.ptr, x.nbytes, rt.memcpyDeviceToDevice, sptr
            )
        )
        copy_gbs = x.nbytes / t_copy / 1e9
        for bits in bits_list:
            out = cp.empty(encoded_nbytes(n, bits, bucket), cp.uint8)
            t_enc = run(partial(encode, x, bits, bucket, out=out))
            t_sr = run(partial(encode, x, bits, bucket, out=out, stochastic=True, seed=1))
            t_dec = run(partial(decode, out, out=dst))
            t_add = run(partial(decode_add, out, acc))
            row = {"MiB": mib, "bits": bits, "copy_GBps": copy_gbs}
            for name, t in (("encode", t_enc), ("encode_sr", t_sr), ("decode", t_dec),
                            ("decode_add", t_add)):  # fmt: skip
                row[f"{name}_GBps"] = x.nbytes / t / 1e9
                row[f"{name}_vs_copy"] = t_copy / t
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 16, 64, 256],
                    help="MiB of float32 input")  # fmt: skip
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--bucket", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument(
        "--out",
        default=str(REPO / "benchmarks" / "results" / machine_class()),
        help="results folder (default: benchmarks/results/<machine class>/)",
    )
    args = ap.parse_args(argv)

    import cupy as cp

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    rt = cp.cuda.runtime
    versions = f"driver {rt.driverGetVersion()}, runtime {rt.runtimeGetVersion()}"
    print(f"device {dev.id}: {name}, cupy {cp.__version__}, {versions}")

    checks = check_codes(cp)
    bad = [c for c in checks if not c["identical"]]
    print(f"codes: {len(checks) - len(bad)}/{len(checks)} cases identical to the CPU")
    for c in bad[:20]:
        print("  MISMATCH", c)

    rows = throughput(cp, args.sizes, args.bits, args.bucket, args.repeat)
    headers = ["MiB", "bits", "copy GB/s", "enc GB/s", "enc/copy", "enc SR GB/s", "dec GB/s",
               "dec/copy", "dec_add GB/s", "add/copy"]  # fmt: skip
    table = [[r["MiB"], r["bits"], r["copy_GBps"], r["encode_GBps"], r["encode_vs_copy"],
              r["encode_sr_GBps"], r["decode_GBps"], r["decode_vs_copy"], r["decode_add_GBps"],
              r["decode_add_vs_copy"]] for r in rows]  # fmt: skip
    print(format_table(headers, table))
    path = write_json(
        "gpu_codec",
        {
            "device": name,
            "cupy": cp.__version__,
            "bucket_size": args.bucket,
            "repeat": args.repeat,
            "units": "GB/s of float32 input; copy = device-to-device memcpy of the same bytes",
            "codes_identical": not bad,
            "checks": checks,
            "throughput": rows,
        },
        args.out,
    )
    print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
