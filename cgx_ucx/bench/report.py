"""Shared output of the benchmarks: where results go, progress bars, a plain-text table on
the terminal and a JSON record with its provenance.

Results go to the directory the user names (``--out-dir``), else to a new
``./cgx_bench_results/<timestamp>/`` under the current directory: never into the
installed package, and never over the tracked ``benchmarks/results/`` of a checkout, which
only ``--refresh-tracked`` writes, into the folder of this machine's class
(``benchmarks/results/cpu-2core/``: :func:`cgx_ucx.bench.provenance.machine_class`). The
docs' benchmark page is rendered from those files (``python -m cgx_ucx.bench report``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

from ..arrays import check_bits
from ..errors import ConfigError
from . import provenance

__all__ = [
    "DEFAULT_RESULTS_ROOT",
    "MAX_LOCAL_RANKS",
    "HelpFormatter",
    "Progress",
    "add_output_args",
    "arg_error",
    "bits_arg",
    "check_memory",
    "check_rank_buffers",
    "count_arg",
    "default_results_dir",
    "format_table",
    "machine_info",
    "max_threads",
    "nonnegative_number",
    "physical_memory",
    "positive_number",
    "progress",
    "ranks_arg",
    "results_dir",
    "threads_arg",
    "tracked_results_dir",
    "write_json",
]

#: Parent of the per-run result directories, relative to the current directory.
DEFAULT_RESULTS_ROOT = "cgx_bench_results"
_RUN_STAMP = time.strftime("%Y%m%d-%H%M%S")  # one directory per process, however many files


def default_results_dir() -> Path:
    """``./cgx_bench_results/<timestamp of this process>/`` (created on first write)."""
    return Path.cwd() / DEFAULT_RESULTS_ROOT / _RUN_STAMP


def tracked_results_dir() -> Path:
    """``benchmarks/results`` of the source checkout this package runs from.

    Raises FileNotFoundError when the package is not run from a checkout (an installed
    wheel has no tracked results to refresh).
    """
    here = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    if not here.is_dir():
        raise FileNotFoundError(
            f"--refresh-tracked writes a checkout's benchmarks/results/, and {here} is not one"
        )
    return here


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` shows each option's default (not for flags and unset options, where
    "default: None/False" says nothing) and the module doc as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class _DeprecatedOut(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        print(f"note: {option} is deprecated, use --out-dir", file=sys.stderr)
        setattr(namespace, self.dest, values)


#: Most ranks (or other processes) a benchmark starts on this one machine: past this the
#: ranks only queue for the cores, and the figures say nothing (the emulated links'
#: /24 would allow 254, :data:`cgx_ucx.bench.netns.MAX_WORLD`).
MAX_LOCAL_RANKS = 64
#: Codec threads per core at most (``--threads``): beyond a few per core they only queue.
MAX_THREADS_PER_CPU = 4


def max_threads() -> int:
    """Most codec threads a benchmark accepts: :data:`MAX_THREADS_PER_CPU` per CPU."""
    return MAX_THREADS_PER_CPU * (os.cpu_count() or 1)


def count_arg(minimum: int = 1, maximum: int | None = None, why: str = "") -> Any:
    """An argparse ``type``: an integer of at least ``minimum`` and, when given, at most
    ``maximum`` (``why`` says where that limit comes from): a clear usage error otherwise,
    never a silent substitute or a crash later in the run."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            reason = f" ({why})" if why else ""
            raise argparse.ArgumentTypeError(f"must be at most {maximum}{reason}, got {value}")
        return value

    parse.__name__ = "count"  # argparse names the type in its messages
    return parse


def ranks_arg(minimum: int = 2) -> Any:
    """An argparse ``type``: a number of ranks started on this machine, ``minimum`` to
    :data:`MAX_LOCAL_RANKS`."""
    return count_arg(minimum, MAX_LOCAL_RANKS, "ranks started on this one machine")


def threads_arg(text: str) -> int:
    """An argparse ``type``: a thread count, 1 to :func:`max_threads`."""
    cpus = os.cpu_count() or 1
    why = f"{MAX_THREADS_PER_CPU} per CPU, {cpus} CPUs here"
    return count_arg(1, max_threads(), why)(text)


def positive_number(text: str) -> float:
    """An argparse ``type``: a finite number greater than 0 (seconds, sizes, rates)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number greater than 0, got {text}")
    return value


def nonnegative_number(text: str) -> float:
    """An argparse ``type``: a finite number of at least 0 (a time budget)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value


def arg_error(parser: argparse.ArgumentParser, option: str, message: str) -> NoReturn:
    """A usage error about ``option`` found after parsing (a check across options): the
    usage line and ``argument OPTION: message``, exit 2, as argparse's own."""
    parser.error(f"argument {option}: {message}")


def physical_memory() -> int | None:
    """Bytes of physical memory of this machine, or None where the system does not say."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return total if total > 0 else None


def check_memory(parser: argparse.ArgumentParser, option: str, nbytes: float, what: str) -> None:
    """A usage error about ``option`` when ``nbytes`` (what the benchmark will allocate at
    once, ``what`` says how that is counted) exceed this machine's physical memory: the run
    would fail with a MemoryError, or swap, long after it started."""
    total = physical_memory()
    if total is not None and nbytes > total:
        arg_error(
            parser,
            option,
            f"{what} need about {_gib(nbytes)}, more than the {_gib(total)} of physical "
            "memory of this machine",
        )


def check_rank_buffers(
    parser: argparse.ArgumentParser,
    option: str,
    ranks: int,
    per_rank: int,
    nbytes: float,
    label: str,
) -> None:
    """:func:`check_memory` for ``ranks`` ranks that each hold ``per_rank`` buffers of
    ``nbytes`` (``label``: that size as the user gave it, e.g. "64 MiB")."""
    check_memory(
        parser,
        option,
        ranks * per_rank * nbytes,
        f"{label} on {ranks} ranks: {per_rank} buffers of that size per rank",
    )


def _gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.3g} GiB"


def bits_arg(text: str) -> int:
    """An argparse ``type``: a bit width the codec has, 1..8 or 32 (uncompressed), as
    :func:`cgx_ucx.arrays.check_bits` accepts it."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bits must be an integer, got {text!r}") from None
    try:
        return check_bits(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """``--out-dir``, its deprecated alias ``--out``, and ``--refresh-tracked``."""
    parser.add_argument(
        "--out-dir",
        default=None,
        help=f"directory for the results (default: a new ./{DEFAULT_RESULTS_ROOT}/<timestamp>/)",
    )
    parser.add_argument(
        "--out", dest="out_dir", action=_DeprecatedOut, help="deprecated alias of --out-dir"
    )
    parser.add_argument(
        "--refresh-tracked",
        action="store_true",
        help="write the checkout's tracked benchmarks/results/<machine class>/ (the figures "
        "the docs render)",
    )


def results_dir(args: argparse.Namespace) -> Path:
    """Where this run writes: ``--refresh-tracked`` (the checkout's
    ``benchmarks/results/<machine class>/``), else ``--out-dir``, else a new directory under
    ``./cgx_bench_results/``."""
    if getattr(args, "refresh_tracked", False):
        return tracked_results_dir() / provenance.machine_class()
    out = getattr(args, "out_dir", None)
    return Path(out) if out else default_results_dir()


class Progress:
    """A progress bar: tqdm when installed (the bench extra), else a line per update at
    most every few seconds, so that a log shows the run is alive."""

    def __init__(
        self, total: int, desc: str, *, disable: bool = False, stream: TextIO | None = None
    ) -> None:
        self.total, self.desc, self.disable = total, desc, disable
        self.n = 0
        self._stream = stream if stream is not None else sys.stderr
        self._last = 0.0
        self._start = time.monotonic()
        self._bar: Any = None
        if not disable:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=total, desc=desc, file=self._stream, dynamic_ncols=True)

    def update(self, n: int = 1, note: str = "") -> None:
        self.n += n
        if self.disable:
            return
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= 2.0 or self.n >= self.total:
            self._last = now
            print(
                f"{self.desc}: {self.n}/{self.total} ({now - self._start:.0f} s) {note}".rstrip(),
                file=self._stream,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress(
    items: Iterable[Any], total: int, desc: str, *, disable: bool = False
) -> Iterator[Any]:
    """Iterate ``items`` with a :class:`Progress` bar."""
    with Progress(total, desc, disable=disable) as bar:
        for item in items:
            yield item
            bar.update()


def machine_info() -> dict[str, Any]:
    """Host name, architecture, Python, logical cores and local time: the short ``machine``
    record of a result (its ``provenance`` holds the rest)."""
    return {
        "host": platform.node(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Right-aligned columns; floats with 3 significant decimals."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return (
                f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3f}".rstrip("0").rstrip(".")
            )
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in text]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in text]
    return "\n".join(lines)


def write_json(name: str, record: dict[str, Any], out_dir: str | Path | None = None) -> Path:
    """Write ``record`` to ``<out_dir>/<name>.json`` (default: a new
    ``./cgx_bench_results/<timestamp>/``) with the machine info and the ``provenance`` block
    (:func:`cgx_ucx.bench.provenance.collect`: command, commit, date, host, versions, load
    before and after); returns the path. Every benchmark writes its result through here."""
    out = Path(out_dir) if out_dir else default_results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    payload = {
        "benchmark": name,
        "machine": machine_info(),
        "provenance": provenance.collect(),
        **record,
    }
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path
