"""One line per part of ``benchmarks/device_check.sh``, read from the part's result JSON.

    python benchmarks/device/verdict.py PART --rc N [--json FILE] [--tests-rc N] [--lines F]
    python benchmarks/device/verdict.py summary --lines F --out FILE

Each part's line reads ``PASS``, ``FAIL`` or ``SKIP``, the part's number and name, and its
figures against the target. The figures are computed from the result's rows at whatever
size ran (the dry run's tiny sizes too), with the targets below; ``--rc`` is the exit
status of the part's command (124: it ran past its time). ``--lines`` appends the line to
a file; ``summary`` writes those lines, with the provenance block, to one JSON. A copy of
the checkout without ``.git`` cannot name its commit: ``summary --commit`` (from
``CGX_DEVICE_COMMIT``) names it in the results that lack one, marked as given.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from cgx_ucx.bench import provenance  # noqa: E402
from cgx_ucx.bench.nodes import (  # noqa: E402
    TARGET_BYTES_TOL,
    TARGET_OVER_FLAT,
    TARGET_OVER_GLOO,
)

NAMES = {
    "1": "GPU tests and codec",
    "2": "bench nodes 2x2",
    "3": "bench link 2 ranks",
    "4": "DDP peers",
    "5": "p2p cuda_ipc",
}
#: bench link at 10 Gbit/s: the 64 MiB 4-bit allreduce within this of its lower bound.
TARGET_LINK_X_BOUND = 1.5
#: The bits of the cases the targets are about.
TARGET_BITS = 4


def _largest(rows: list[dict[str, Any]], method: str) -> dict[str, Any] | None:
    found = [r for r in rows if r.get("method") == method]
    return max(found, key=lambda r: r["size"]) if found else None


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):g} MiB"


def part1(data: dict[str, Any], tests_rc: int | None) -> tuple[bool, str]:
    """GPU tests passed, codes identical to the CPU's, throughput against the copy."""
    rows = [r for r in data["throughput"] if r["bits"] == TARGET_BITS] or data["throughput"]
    big = max(rows, key=lambda r: r["MiB"])
    ok = bool(data["codes_identical"]) and tests_rc == 0
    tests = {None: "tests not run", 0: "tests pass"}.get(tests_rc, f"tests FAILED ({tests_rc})")
    checks = data["checks"]
    same = sum(c["identical"] for c in checks)
    return ok, (
        f"{tests}, codes {same}/{len(checks)} identical to the CPU; {big['MiB']:g} MiB "
        f"{big['bits']}-bit encode {big['encode_GBps']:.0f} GB/s "
        f"({big['encode_vs_copy']:.2f}x the device copy's {big['copy_GBps']:.0f} GB/s), "
        f"decode_add {big['decode_add_GBps']:.0f} GB/s ({big['decode_add_vs_copy']:.2f}x)"
    )


def part2(data: dict[str, Any]) -> tuple[bool, str]:
    """Two-level 4-bit against flat and gloo; bytes per node against the formula; CPU."""
    config = data["configs"][0]
    hier = _largest(config["allreduce"], f"hier{TARGET_BITS}")
    if hier is None:
        return False, f"no hier{TARGET_BITS} row"
    over_flat, over_gloo = hier.get("over_flat") or 0.0, hier.get("speedup") or 0.0
    ratio = hier.get("bytes_vs_formula")
    ok = (
        over_flat >= TARGET_OVER_FLAT
        and over_gloo >= TARGET_OVER_GLOO
        and ratio is not None
        and abs(ratio - 1) <= TARGET_BYTES_TOL
    )
    cpu = hier.get("cpu_s_per_rank") or []
    cpu_text = "/".join(f"{1e3 * c:.0f}" for c in cpu) + " CPU-ms per rank" if cpu else "no CPU"
    ratio_text = f"{ratio:.3f}x" if ratio is not None else "no count of"
    return ok, (
        f"{_mib(hier['size'])} {config['link']['rate']}: two-level {1e3 * hier['time_s']:.1f} ms, "
        f"{over_flat:.2f}x flat (>= {TARGET_OVER_FLAT:g}), {over_gloo:.2f}x gloo "
        f"(>= {TARGET_OVER_GLOO:g}), bytes/node {ratio_text} the formula "
        f"(within {100 * TARGET_BYTES_TOL:g}%), {cpu_text}, levels {config.get('levels')}"
    )


def part3(data: dict[str, Any]) -> tuple[bool, str]:
    """cgx 4-bit against its lower bound."""
    config = data["configs"][0]
    row = _largest(config["allreduce"], f"cgx{TARGET_BITS}")
    if row is None:
        return False, f"no cgx{TARGET_BITS} row"
    x_bound = row.get("x_bound")
    ok = x_bound is not None and x_bound <= TARGET_LINK_X_BOUND
    bound = f"{x_bound:.2f}x" if x_bound is not None else "no"
    return ok, (
        f"{_mib(row['size'])} {config['link']['rate']}: cgx{TARGET_BITS} "
        f"{1e3 * row['time_s']:.1f} ms, {bound} the lower bound "
        f"({1e3 * (row.get('bound_s') or 0):.1f} ms; target <= {TARGET_LINK_X_BOUND:g}x), "
        f"{row['speedup']:.2f}x gloo"
    )


def headline(data: dict[str, Any]) -> tuple[bool, str]:
    """The result's own verdict (ddp_peers, p2p_ipc)."""
    head = data["headline"][0]
    return bool(head["met"]), head["text"]


def line(part: str, rc: int, path: Path | None, tests_rc: int | None) -> str:
    name = f"part {part} {NAMES.get(part, '')}".rstrip()
    if rc == 124:
        return f"FAIL {name}: ran past its time limit"
    if path is None or not path.is_file():
        return f"FAIL {name}: exit {rc}, no result JSON"
    try:
        data = json.loads(path.read_text())
        if part == "1":
            ok, text = part1(data, tests_rc)
        elif part == "2":
            ok, text = part2(data)
        elif part == "3":
            ok, text = part3(data)
        else:
            ok, text = headline(data)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        return f"FAIL {name}: exit {rc}, unreadable result {path.name} ({exc!r})"
    where = "" if rc == 0 else f" (exit {rc})"
    return f"{'PASS' if ok and rc == 0 else 'FAIL'} {name}{where}: {text}"


def fill_commit(results: Path, commit: str) -> list[str]:
    """Name ``commit`` in the provenance of every result JSON in ``results`` that has none
    (a copy of the checkout without ``.git``); returns the files changed."""
    changed = []
    for path in sorted(results.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        block = data.get("provenance")
        if isinstance(block, dict) and not block.get("git"):
            block["git"] = {"commit": commit, "dirty": None, "given_by": "CGX_DEVICE_COMMIT"}
            path.write_text(json.dumps(data, indent=2) + "\n")
            changed.append(path.name)
    return changed


def summary(lines_file: Path, out: Path, commit: str | None = None) -> None:
    lines = lines_file.read_text().splitlines() if lines_file.is_file() else []
    block = provenance.collect()
    if commit and not block.get("git"):
        block["git"] = {"commit": commit, "dirty": None, "given_by": "CGX_DEVICE_COMMIT"}
    record = {
        "benchmark": "device_check",
        "provenance": block,
        "parts": lines,
        "passed": sum(x.startswith("PASS") for x in lines),
        "failed": sum(x.startswith("FAIL") for x in lines),
        "skipped": sum(x.startswith("SKIP") for x in lines),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=[*NAMES, "summary"])
    ap.add_argument("--rc", type=int, default=0, help="exit status of the part's command")
    ap.add_argument("--json", type=Path, help="the part's result")
    ap.add_argument("--tests-rc", type=int, help="part 1: exit status of the GPU tests")
    ap.add_argument("--lines", type=Path, help="append the line here (summary: read them)")
    ap.add_argument("--out", type=Path, help="summary: the JSON to write")
    ap.add_argument("--results", type=Path, help="summary: the parts' result folder")
    ap.add_argument("--commit", help="summary: the commit to name where .git is absent")
    args = ap.parse_args(argv)
    if args.part == "summary":
        if args.lines is None or args.out is None:
            ap.error("summary needs --lines and --out")
        summary(args.lines, args.out, args.commit)
        if args.commit and args.results is not None and args.results.is_dir():
            changed = fill_commit(args.results, args.commit)
            if changed:
                print(f"commit {args.commit} named in the provenance of {', '.join(changed)}")
        return 0
    text = line(args.part, args.rc, args.json, args.tests_rc)
    print(text, flush=True)
    if args.lines is not None:
        with args.lines.open("a") as f:
            f.write(text + "\n")
    return 0 if text.startswith("PASS") else 1


if __name__ == "__main__":
    sys.exit(main())
