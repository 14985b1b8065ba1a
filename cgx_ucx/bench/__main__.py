"""The benchmark command line: ``python -m cgx_ucx.bench <name> [options]`` (or ``cgx-bench``).

Each benchmark is a module ``cgx_ucx.bench.<name>`` exposing ``main(argv) -> int``;
every one shows its progress, prints a table and writes JSON to ``--out-dir`` (default: a
new ``./cgx_bench_results/<timestamp>/`` under the current directory). Only
``--refresh-tracked`` overwrites the checkout's recorded
``benchmarks/results/<machine class>/``, and ``python -m cgx_ucx.bench report`` renders the
docs' benchmark page and the README's headline table from those files.
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
    "memory": "RSS after init, held after all_reduce and peak, per size: gloo against cgx",
    "ft": "torchft fault tolerance: kill and rejoin, DDP per step and DiLoCo, gloo against cgx",
}
#: Commands that are not benchmarks, by name: the module that runs each.
TOOLS = {
    "report": (
        "pages",
        "render docs/benchmarks.md and the README's headline table from benchmarks/results/",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS.keys() | TOOLS.keys():
        print(
            "usage: python -m cgx_ucx.bench {" + ",".join([*BENCHMARKS, *TOOLS]) + "} [options]\n"
        )
        for name, text in BENCHMARKS.items():
            print(f"  {name:10s} {text}")
        for name, (_module, text) in TOOLS.items():
            print(f"  {name:10s} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module_name = TOOLS[argv[0]][0] if argv[0] in TOOLS else argv[0]
    module = importlib.import_module(f"cgx_ucx.bench.{module_name}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
