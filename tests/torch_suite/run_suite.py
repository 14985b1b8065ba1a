"""Run torch's own distributed test suite (``distributed_test._DistTestBase``) on a backend.

PyTorch runs that class once per backend through ``test/distributed/test_distributed_spawn.py``
(``BACKEND=gloo WORLD_SIZE=2 TEMP_DIR=... python test_distributed_spawn.py``). torch's
``test/`` folder is not installed with the wheel, so ``suite.py`` rebuilds the few lines of
that wrapper; this command sets the environment it needs and runs the selected tests::

    # one backend, one world size (the CI subset, or every CPU test with --subset full)
    python tests/torch_suite/run_suite.py run --backend cgx --world-size 2 --json cgx2.json
    # the parity check: what passes on gloo and not on cgx, each explained in parity.py or not
    python tests/torch_suite/run_suite.py parity gloo2.json cgx2.json
    # everything: gloo and cgx at world sizes 2 and 3, every CPU test, then the parity check
    python tests/torch_suite/run_suite.py full --out-dir suite_results

Each ``run`` is its own process because torch's module reads ``BACKEND`` when imported.
``run`` exits 1 when a test outside ``parity.py`` did not pass (on gloo: when any test
failed), ``parity`` when a difference from gloo is not explained there.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import parity  # noqa: E402
import selection  # noqa: E402

#: Seconds before torch's harness kills one hung test (its default is 300).
DEFAULT_TEST_TIMEOUT = 120


_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b.*")


def _message(err_text: str) -> str:
    """The line that says what went wrong: the last exception line of the first rank's
    traceback in torch's "Process i exited with error code 10 and exception: ..." text
    (or of the parent's traceback when no rank reported one)."""
    blocks = re.split(
        r"^Process \d+ exited with error code \d+ and exception:$", err_text, flags=re.M
    )
    text = blocks[1] if len(blocks) > 1 else blocks[0]
    found = [ln for ln in text.splitlines() if _EXC_LINE.match(ln)]
    if found:
        return found[-1][:300]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


class _Recorder(unittest.TextTestResult):
    """Keeps one outcome per test: passed, failed, skipped (with the reason)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict[str, Any]] = {}
        self._started = 0.0

    @staticmethod
    def _name(test: unittest.TestCase) -> str:
        return test.id().rsplit(".", 1)[-1]

    def startTest(self, test: unittest.TestCase) -> None:
        self._started = time.monotonic()
        super().startTest(test)

    def _set(self, test: unittest.TestCase, outcome: str, message: str = "") -> None:
        self.outcomes[self._name(test)] = {
            "outcome": outcome,
            "message": message,
            "seconds": round(time.monotonic() - self._started, 1),
        }

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._set(test, "passed")

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._set(test, "skipped", reason)

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._set(test, "failed", _message(self._exc_info_to_string(err, test)))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._set(test, "failed", _message(self._exc_info_to_string(err, test)))


def _environment(
    backend: str,
    world_size: int,
    bits: int | None,
    test_timeout: int,
    start_method: str,
    gloo_gated: bool,
) -> None:
    """What test_distributed_spawn.py expects in the environment, set before torch's
    distributed_test is imported (here and, inherited, in every spawned rank)."""
    temp_dir = tempfile.mkdtemp(prefix=f"cgx-suite-{backend}{world_size}-")
    os.makedirs(os.path.join(temp_dir, "barrier"))
    os.environ.update(
        BACKEND=backend,
        WORLD_SIZE=str(world_size),
        TEMP_DIR=temp_dir,
        INIT_METHOD=os.environ.get("INIT_METHOD", "env://"),
        DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(test_timeout),
        OMP_NUM_THREADS="1",  # every rank shares the machine's cores
        CGX_SUITE_START_METHOD=start_method,
        CGX_SUITE_GLOO_GATED="1" if gloo_gated else "0",
        PYTORCH_PRINT_REPRO_ON_FAILURE="0",
    )
    if bits is not None:
        os.environ["CGX_COMPRESSION_QUANTIZATION_BITS"] = str(bits)
    else:
        os.environ.pop("CGX_COMPRESSION_QUANTIZATION_BITS", None)


def run(
    backend: str,
    world_size: int,
    subset: str = "ci",
    only: list[str] | None = None,
    *,
    bits: int | None = None,
    test_timeout: int = DEFAULT_TEST_TIMEOUT,
    start_method: str = "forkserver",
    gloo_gated: bool = False,
    verbosity: int = 1,
) -> dict[str, Any]:
    """Run the ``subset`` tests (those containing one of ``only``, when given) on
    ``backend`` in this process; return the JSON-ready report."""
    _environment(backend, world_size, bits, test_timeout, start_method, gloo_gated)
    if start_method == "forkserver":
        # The server imports ``suite`` by name, from PYTHONPATH: Python 3.11's forkserver
        # does not apply the parent's sys.path before it preloads.
        paths = [str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)
        multiprocessing.set_forkserver_preload(["suite"])
    import suite  # reads BACKEND: only now

    names = selection.select(subset, suite.test_names(), only)
    tests = unittest.TestSuite(suite.TestDistBackendWithSpawn(n) for n in names)
    runner = unittest.TextTestRunner(resultclass=_Recorder, verbosity=verbosity, stream=sys.stderr)
    started = time.monotonic()
    result = runner.run(tests)
    import torch

    return {
        "backend": backend,
        "world_size": world_size,
        "bits": bits if bits is not None else 32,
        "torch": torch.__version__,
        "subset": subset,
        "gloo_gated": gloo_gated,
        "seconds": round(time.monotonic() - started, 1),
        "results": result.outcomes,  # type: ignore[attr-defined]
    }


def _stale_checked(entry: parity.Entry, report: dict[str, Any]) -> bool:
    """Whether a listed test that passes means the entry is stale: not for flaky tests,
    nor for gloo-gated tests in a --gloo-gated run (passing there is what it shows)."""
    if entry.kind == parity.FLAKY:
        return False
    return not (entry.kind == parity.GLOO_ONLY and report.get("gloo_gated"))


def unexpected(report: dict[str, Any]) -> list[str]:
    """Tests of a cgx report that did not pass and are not explained in parity.py (on
    gloo: every failure), plus parity entries that pass now (stale: remove them)."""
    world, bits = report["world_size"], report["bits"]
    problems = []
    for name, res in sorted(report["results"].items()):
        if report["backend"] != "cgx":
            if res["outcome"] == "failed":
                problems.append(f"{name}: fails on {report['backend']}: {res['message']}")
            continue
        entry = parity.lookup(name, world, bits)
        if res["outcome"] == "failed" and entry is None:
            problems.append(f"{name}: fails on cgx, not in parity.py: {res['message']}")
        elif res["outcome"] == "passed" and entry is not None and _stale_checked(entry, report):
            problems.append(f"{name}: passes on cgx now; remove it from parity.py ({entry.reason})")
    return problems


def compare(gloo: dict[str, Any], cgx: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(explained, unexplained) lines for every test that passes on gloo and not on cgx."""
    explained, unexplained = [], []
    world, bits = cgx["world_size"], cgx["bits"]
    for name, res in sorted(gloo["results"].items()):
        if res["outcome"] != "passed":
            continue
        mine = cgx["results"].get(name)
        if mine is None or mine["outcome"] == "passed":
            continue
        entry = parity.lookup(name, world, bits)
        line = f"{name} [{mine['outcome']}: {mine['message']}]"
        if entry is None:
            unexplained.append(line)
        else:
            explained.append(f"{line} -> {entry.kind}: {entry.reason}")
    return explained, unexplained


def _cmd_run(args: argparse.Namespace) -> int:
    report = run(
        args.backend,
        args.world_size,
        args.subset,
        args.k,
        bits=args.bits,
        test_timeout=args.test_timeout,
        start_method=args.start_method,
        gloo_gated=args.gloo_gated,
        verbosity=args.verbosity,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    counts: dict[str, int] = {}
    for res in report["results"].values():
        counts[res["outcome"]] = counts.get(res["outcome"], 0) + 1
    print(
        f"{args.backend} world {args.world_size}: {counts} in {report['seconds']:.0f} s",
        flush=True,
    )
    problems = unexpected(report)
    for line in problems:
        print("UNEXPECTED", line, flush=True)
    return 1 if problems else 0


def _cmd_parity(args: argparse.Namespace) -> int:
    gloo = json.loads(Path(args.gloo).read_text())
    cgx = json.loads(Path(args.cgx).read_text())
    explained, unexplained = compare(gloo, cgx)
    print(f"world {cgx['world_size']}, bits {cgx['bits']}: passes on gloo, not on cgx")
    for line in explained:
        print("  explained  ", line)
    for line in unexplained:
        print("  UNEXPLAINED", line)
    return 1 if unexplained else 0


def _cmd_full(args: argparse.Namespace) -> int:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rc = 0
    for world in args.world_size:
        paths = {}
        for backend in ("gloo", "cgx"):
            paths[backend] = out / f"{backend}{world}.json"
            cmd = [sys.executable, __file__, "run", "--backend", backend]
            cmd += ["--world-size", str(world), "--subset", "full", "--json", str(paths[backend])]
            if args.bits is not None and backend == "cgx":
                cmd += ["--bits", str(args.bits)]
            subprocess.run(cmd, check=False)
        cmd = [sys.executable, __file__, "parity", str(paths["gloo"]), str(paths["cgx"])]
        rc |= subprocess.run(cmd, check=False).returncode
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="run the selection on one backend and world size")
    p_run.add_argument("--backend", default="cgx", choices=["cgx", "gloo"])
    p_run.add_argument("--world-size", type=int, default=2)
    p_run.add_argument("--subset", default="ci", choices=["ci", "ci3", "full"])
    p_run.add_argument("-k", action="append", help="only tests whose name contains this")
    p_run.add_argument("--bits", type=int, help="CGX_COMPRESSION_QUANTIZATION_BITS for cgx")
    p_run.add_argument("--json", help="write the report here")
    p_run.add_argument("--test-timeout", type=int, default=DEFAULT_TEST_TIMEOUT)
    p_run.add_argument(
        "--start-method",
        default="forkserver",
        choices=["forkserver", "spawn"],
        help="how ranks start: spawn is test_distributed_spawn.py's; forkserver imports "
        "torch's test module once and forks each rank from it (faster, same tests)",
    )
    p_run.add_argument(
        "--gloo-gated",
        action="store_true",
        help="cgx only: admit the tests torch gates on the name 'gloo' (see suite.py)",
    )
    p_run.add_argument("--verbosity", type=int, default=2)
    p_run.set_defaults(fn=_cmd_run)
    p_par = sub.add_parser("parity", help="compare a gloo report with a cgx report")
    p_par.add_argument("gloo")
    p_par.add_argument("cgx")
    p_par.set_defaults(fn=_cmd_parity)
    p_full = sub.add_parser("full", help="gloo and cgx, every CPU test, then parity")
    p_full.add_argument("--world-size", type=int, nargs="+", default=[2, 3])
    p_full.add_argument("--bits", type=int)
    p_full.add_argument("--out-dir", default="suite_results")
    p_full.set_defaults(fn=_cmd_full)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
