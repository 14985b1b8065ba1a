"""torch's own distributed test suite on the cgx backend.

The runner is ``tests/torch_suite/run_suite.py``: it runs the tests of torch's
``distributed_test.DistributedTest._DistTestBase`` (the class PyTorch's
``test_distributed_spawn.py`` runs per backend) with ``BACKEND=cgx``; ``suite.py`` says
how cgx is registered in the spawned ranks and declared in torch's feature table, and
``parity.py`` is the one list of tests that pass on gloo and not on cgx, with the reason.

Here: a fixed representative subset (``selection.CI``: each collective family,
point-to-point, subgroups, object collectives, CPU DDP) at world size 2, and its part
where a third rank changes the code path (``selection.CI3``) at 3. A test
fails when a subset test that is not in ``parity.py`` does not pass on cgx, or when one
that is listed passes now (the entry is stale: remove it).

The full set (every CPU test, gloo and cgx, world sizes 2 and 3, then the parity report;
tens of minutes)::

    python tests/torch_suite/run_suite.py full --out-dir suite_results
    python tests/torch_suite/run_suite.py full --bits 4 --out-dir suite_results_4bit

The tests torch gates on the name "gloo" (coalesced all_reduce, get_future,
batch_isend_irecv_gloo, ...), admitted and run on cgx (see ``suite.py``)::

    python tests/torch_suite/run_suite.py run --backend cgx --subset full --gloo-gated \
        -k coalesced -k get_future -k batch_isend_irecv --json cgx2gated.json

One backend, one world size, chosen tests::

    python tests/torch_suite/run_suite.py run --backend cgx --world-size 3 --subset full \\
        -k all_to_all -k send_recv --json cgx3.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parent / "torch_suite"
sys.path.insert(0, str(SUITE))

import parity  # noqa: E402
import run_suite  # noqa: E402
import selection  # noqa: E402

RUN_TIMEOUT = 600  # seconds for one world size of the subset


def test_parity_entries_are_well_formed() -> None:
    kinds = {parity.GLOO_ONLY, parity.COMPRESSION, parity.MISSING_OP, parity.FLAKY}
    for name, entry in parity.PARITY.items():
        assert name.startswith("test_"), name
        assert entry.kind in kinds, (name, entry)
        assert entry.reason, name
        if entry.kind == parity.MISSING_OP:
            assert entry.reason.startswith(f"{parity.MISSING_OP}: "), name


def test_message_is_the_ranks_exception_line() -> None:
    text = (
        "Process 0 exited with error code 10 and exception:\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n'
        "cgx_ucx.errors.CGXError: no send\n\n"
        "Process 1 exited with error code 10 and exception:\n"
        "RuntimeError: other\n"
    )
    assert run_suite._message(text) == "cgx_ucx.errors.CGXError: no send"


# World 3 runs the "ci3" subset: the tests where an odd world size changes the code path.
@pytest.mark.parametrize("world_size", [2, 3])
def test_ci_subset_on_cgx(world_size: int, tmp_path: Path) -> None:
    out = tmp_path / f"cgx{world_size}.json"
    cmd = [sys.executable, str(SUITE / "run_suite.py"), "run", "--backend", "cgx"]
    subset = "ci" if world_size == 2 else "ci3"
    cmd += ["--world-size", str(world_size), "--subset", subset, "--json", str(out)]
    cmd += ["--test-timeout", "90"]
    env = dict(os.environ)
    env.pop("CGX_COMPRESSION_QUANTIZATION_BITS", None)  # the parity run is uncompressed
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert out.exists(), proc.stdout + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == set(selection.CI if world_size == 2 else selection.CI3)
    problems = run_suite.unexpected(report)
    assert not problems, "\n".join(problems) + "\n" + proc.stdout[-3000:]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
