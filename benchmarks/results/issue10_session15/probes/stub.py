"""Probe (not a command), issue 10 session 15: session 12's ``stub.py`` (the torch layer's
own per-call cost, the engine stubbed out) for the torch layer as it is from session 15,
which calls the engine's ``allreduce_now`` (a call done on this thread comes back as its
value, no future made) instead of ``allreduce``. Run from the repository root:
``.venv/bin/python benchmarks/results/issue10_session15/probes/stub.py``.
"""

import runpy

from cgx_ucx.engine import SyncCommunicator

SyncCommunicator.allreduce_now = lambda self, x, op="sum", **kw: (x, None)
runpy.run_path("benchmarks/results/issue10_session12/probes/stub.py", run_name="__main__")
