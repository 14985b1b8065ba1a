"""The benchmark command line: ``python -m cgx_ucx.bench <name> [options]`` (or ``cgx-bench``).

Each benchmark is a module ``cgx_ucx.bench.<name>`` exposing ``main(argv) -> int``;
every one shows its progress, prints a table and writes JSON to ``--out-dir`` (default: a
new ``./cgx_bench_results/<timestamp>/`` under the current directory). Only
``--refresh-tracked`` overwrites the checkout's recorded ``benchmarks/results/``.
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "codec": "quantization codec throughput against memcpy (Numba, NumPy reference)",
    "allreduce": "cgx_ucx allreduce against torch.distributed gloo, same processes",
    "link": "emulated commodity links (network namespaces + tc): allreduce and training",
    "nodes": "emulated nodes x ranks per node: gloo vs flat vs hierarchical cgx, link bytes",
    "latency": "small-call latency hop by hop (torch backend, engine thread, asyncio core)",
    "contention": "DDP step time beside a CPU hog: cgx 4-bit against gloo",
    "train": "training step time and accuracy: compression policies against uncompressed",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print("usage: python -m cgx_ucx.bench {" + ",".join(BENCHMARKS) + "} [options]\n")
        for name, text in BENCHMARKS.items():
            print(f"  {name:10s} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(f"cgx_ucx.bench.{argv[0]}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
