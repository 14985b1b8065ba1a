# ruff: noqa
"""Probe (not a command), issue 11 session 15: runs cpu_worker.py on 2 emulated nodes x 2
ranks at 1 Gbit/s (root). ``python cpu_probe.py hierarchical [VAR=value ...]`` from the
repository root; the extra VAR=value pairs go into every rank's environment."""

import sys
from cgx_ucx.bench.netns import LinkEmulator
from cgx_ucx.bench.link import thread_env

alg = sys.argv[1]
with LinkEmulator(4, 10**9, nodes=2) as link:
    extra = dict(kv.split("=", 1) for kv in sys.argv[2:])
    res = link.run_ranks(
        [sys.executable, "benchmarks/results/issue11_session15_local/probes/cpu_worker.py", alg],
        timeout=600,
        env={**thread_env(4), **extra},
    )
    for r in res:
        print(getattr(r, "stdout", r))
