"""Imported once by the test harness's fork server, so that each spawned rank starts forked
from a process that has already paid for ``import torch`` (about 3 s of each rank's start
on 2 cores; the suite starts several hundred ranks).

Only modules whose import reads no per-rank setting are loaded here: UCX, Numba and
cgx_ucx read their environment variables when imported or initialised, and the harness
sets each rank's variables after the fork, so they are imported in the rank itself.
The OpenMP runtime that torch loads reads ``OMP_NUM_THREADS`` once, now: one thread per
rank, as the ranks of a test share two cores.
"""

import contextlib
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy  # noqa: F401

with contextlib.suppress(ImportError):  # the engine tests run without torch
    import torch  # noqa: F401
