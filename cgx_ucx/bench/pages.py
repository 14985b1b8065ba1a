"""``python -m cgx_ucx.bench report``: render the docs' benchmark page and the README's
headline table from the checkout's ``benchmarks/results/<machine class>/*.json``.

The page (``docs/benchmarks.md``) has one section per result: what the benchmark measures,
the command that produced it, its tables, a plot (``docs/img/``) and the provenance line.
The README's headline table, between ``<!-- headline:start -->`` and
``<!-- headline:end -->``, holds the current figure of each claim and links to the section
that holds it. ``--check`` renders both and compares them with the files: exit 1 and a diff
when they differ, so that no figure in the docs drifts from its JSON.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import plots
from .provenance import REPO_ROOT
from .report import HelpFormatter
from .sections import (
    RENDERERS,
    SUMMARIES,
    TITLES,
    fmt,
    percent,
    provenance_line,
    ratio,
    table,
)

__all__ = [
    "HEADLINE_END",
    "HEADLINE_START",
    "Result",
    "anchor",
    "check",
    "headline_table",
    "load_results",
    "main",
    "render_page",
    "replace_headline",
]

HEADLINE_START = "<!-- headline:start -->"
HEADLINE_END = "<!-- headline:end -->"
#: Where the page links from the README, relative to the README.
PAGE_LINK = "docs/benchmarks.md"
#: Images of the page, relative to the page.
IMAGE_DIR = "img"
#: The names of the result plots (``<machine class>-<result>.png``): the only images of
#: ``docs/img/`` that rendering replaces or removes.
_IMAGE_NAME = re.compile(r"[a-z0-9]+-\d+core-[A-Za-z0-9_.-]+\.png")
#: Sections in this order within a machine class; other results follow by name.
ORDER = [
    "codec",
    "allreduce",
    "latency",
    "latency_cold",
    "link",
    "link_1gbit_fsdp",
    "nodes",
    "nodes_train",
    "contention",
    "train",
    "train_1gbit",
    "gpu_codec",
]
INTRO = """\
Each benchmark is a command that shows its progress, prints a table and writes a JSON result
(`python -m cgx_ucx.bench <name> --help` lists its options). Every comparison in a table is
measured side by side in one run: cgx_ucx against torch.distributed gloo, the codec against a
memcpy of the same bytes. `--refresh-tracked` writes the result into
`benchmarks/results/<machine class>/`; this page is rendered from those files by
`python -m cgx_ucx.bench report`, and `bash benchmarks/refresh.sh` re-runs every CPU benchmark
on it. Each section names the command that produced its figures and the machine, commit and
load it ran at. Compare the rows of one table, not tables of different runs or machines."""


@dataclass(frozen=True)
class Result:
    """One result file: its machine class (folder), name (file stem) and parsed JSON."""

    machine_class: str
    name: str
    data: dict[str, Any]

    @property
    def benchmark(self) -> str:
        return str(self.data.get("benchmark", self.name))

    @property
    def kind(self) -> str:
        """The renderer's key: the ``benchmark`` field, or the longest ``_``-prefix of it or
        of the file name that has a renderer (``train_1gbit`` is a ``train`` result)."""
        for candidate in (self.benchmark, self.name):
            while candidate:
                if candidate in RENDERERS:
                    return candidate
                candidate = candidate.rpartition("_")[0]
        return self.benchmark

    @property
    def title(self) -> str:
        return f"{TITLES.get(self.name, self.name)} ({self.machine_class})"

    @property
    def anchor(self) -> str:
        return anchor(self.title)

    @property
    def image(self) -> str:
        return f"{IMAGE_DIR}/{self.machine_class}-{self.name}.png"


def anchor(title: str) -> str:
    """The fragment both GitHub and MkDocs give a heading: lower case, punctuation dropped,
    spaces as hyphens."""
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).strip().replace(" ", "-")


def _class_key(name: str) -> tuple[int, str]:
    return (0 if name.startswith("cpu-") else 1, name)


def _result_key(result: Result) -> tuple[int, str]:
    rank = ORDER.index(result.name) if result.name in ORDER else len(ORDER)
    return (rank, result.name)


def load_results(root: Path) -> list[Result]:
    """Every ``<root>/<machine class>/*.json``, in page order."""
    results = []
    for folder in sorted(
        (p for p in root.iterdir() if p.is_dir()), key=lambda p: _class_key(p.name)
    ):
        found = [
            Result(folder.name, f.stem, json.loads(f.read_text())) for f in folder.glob("*.json")
        ]
        results += sorted(found, key=_result_key)
    return results


def _command(result: Result) -> str:
    prov = result.data.get("provenance")
    if isinstance(prov, dict) and prov.get("command"):
        return f"Command: `{prov['command']}`"
    return "Command: not recorded."


def _section(result: Result, results_label: str) -> Iterator[str]:
    yield f"### {result.title}"
    summary = SUMMARIES.get(result.name) or SUMMARIES.get(result.kind)
    if summary:
        yield summary
    yield _command(result)
    render = RENDERERS.get(result.kind)
    if render is None:
        yield "This page has no table for this benchmark; the figures are in its JSON."
    else:
        yield from render(result.data)
    if plots.drawable(result.kind, result.data):
        yield f"![{result.title}]({result.image})"
    yield provenance_line(result.data)
    yield f"Source: `{results_label}/{result.machine_class}/{result.name}.json`."


def _hosts(results: list[Result]) -> Iterator[str]:
    for machine_class in sorted({r.machine_class for r in results}, key=_class_key):
        mine = [r for r in results if r.machine_class == machine_class]
        hosts = set()
        for r in mine:
            host = (r.data.get("provenance") or {}).get("host")
            if host:
                hosts.add(f"{host.get('cpu')}, {host.get('logical_cores')} logical cores")
        text = "; ".join(sorted(hosts)) if hosts else "hosts not recorded"
        yield f"- `{machine_class}`: {len(mine)} results ({text})."


def render_page(results: list[Result], results_label: str = "benchmarks/results") -> str:
    """The Markdown of ``docs/benchmarks.md`` for ``results``."""
    blocks = [
        "# Benchmarks",
        "<!-- Rendered by `python -m cgx_ucx.bench report` from benchmarks/results/: "
        "do not edit by hand. -->",
        INTRO,
        "Machine classes (the folders of `benchmarks/results/`):",
        "\n".join(_hosts(results)),
    ]
    current = None
    for result in results:
        if result.machine_class != current:
            current = result.machine_class
            blocks.append(f"## {current}")
        blocks += list(_section(result, results_label))
    return "\n\n".join(blocks) + "\n"


def _find(results: list[Result], name: str, machine_class: str | None = None) -> Result | None:
    for result in results:
        if result.name == name and (machine_class is None or result.machine_class == machine_class):
            return result
    return None


def _link(result: Result, text: str) -> str:
    return f"[{text}]({PAGE_LINK}#{result.anchor})"


def _codec_row(results: list[Result]) -> list[str] | None:
    result = _find(results, "codec")
    rows = [r for r in (result.data.get("rows") or []) if r.get("bits") == 4] if result else []
    if not result or not rows:
        return None
    r = next((r for r in rows if r.get("MiB") == 16), rows[-1])
    figure = (
        f"4-bit encode of {fmt(r.get('MiB'))} MiB at {fmt(r.get('encode_GBps'))} GB/s, "
        f"{ratio(r.get('encode_vs_memcpy'))} the speed of a memcpy of the same bytes"
    )
    return ["Codec on the CPU", figure, _link(result, result.title)]


def _latency_row(results: list[Result]) -> list[str] | None:
    result = _find(results, "latency")
    rows = result.data.get("rows") if result else None
    if not result or not rows:
        return None

    def median(method: str) -> Any:
        for r in rows:
            if (r.get("world"), r.get("kib"), r.get("path"), r.get("method")) == (
                2,
                4,
                "torch",
                method,
            ):
                return r.get("median_us")
        return None

    gloo, cgx = median("gloo"), median("cgx32")
    if not gloo or not cgx:
        return None
    figure = (
        f"4 KiB `all_reduce`, 2 ranks: {fmt(cgx)} us against {fmt(gloo)} us for gloo "
        f"({ratio(cgx / gloo)} the time)"
    )
    return ["Small calls on one host", figure, _link(result, result.title)]


def _link_config(result: Result | None, world: int, rate: str) -> dict[str, Any] | None:
    for config in (result.data.get("configs") or []) if result else []:
        if config.get("world_size") == world and (config.get("link") or {}).get("rate") == rate:
            return config
    return None


def _link_rows(results: list[Result]) -> list[list[str]]:
    rows = []
    result = _find(results, "link")
    config = _link_config(result, 2, "1gbit")
    if result and config:
        hit = {r["method"]: r for r in config.get("allreduce", []) if r.get("size") == 64 << 20}
        if "gloo" in hit and "cgx4" in hit:
            gloo, cgx = hit["gloo"]["time_s"] * 1e3, hit["cgx4"]["time_s"] * 1e3
            figure = (
                f"64 MiB, 2 ranks: {fmt(cgx)} ms at 4 bits against {fmt(gloo)} ms for gloo "
                f"({ratio(gloo / cgx)})"
            )
            rows.append(
                ["All-reduce over an emulated 1 Gbit/s link", figure, _link(result, result.title)]
            )
        train = {r.get("backend"): r for r in config.get("train") or []}
        if "gloo" in train and "cgx" in train:
            cgx = train["cgx"]
            figure = (
                f"22 M-parameter MLP, 2 ranks, {cgx.get('bits')} bits: {ratio(cgx.get('speedup'))} "
                f"gloo's step rate, held-out loss {percent(cgx.get('loss_vs_gloo'))} of gloo's"
            )
            rows.append(
                ["DDP training over an emulated 1 Gbit/s link", figure, _link(result, result.title)]
            )
    result = _find(results, "link_1gbit_fsdp")
    config = _link_config(result, 2, "1gbit")
    if result and config:
        fsdp = {r.get("method"): r for r in config.get("fsdp") or []}
        if "cgx4" in fsdp:
            cgx = fsdp["cgx4"]
            figure = (
                f"same MLP, 2 ranks, 4 bits: {ratio(cgx.get('speedup'))} gloo's step rate, "
                f"held-out loss {percent(cgx.get('loss_vs_gloo'), 3)} of gloo's"
            )
            rows.append(
                ["FSDP2 over an emulated 1 Gbit/s link", figure, _link(result, result.title)]
            )
    return rows


def _cores(result: Result) -> int:
    host = (result.data.get("provenance") or {}).get("host") or {}
    return int(host.get("logical_cores") or (result.data.get("machine") or {}).get("cpus") or 0)


def _nodes_row(results: list[Result]) -> list[str] | None:
    # The host with the most cores first: there the link, not the CPU, bounds the call.
    candidates = sorted((r for r in results if r.name == "nodes"), key=_cores, reverse=True)
    for result in candidates:
        for config in result.data.get("configs") or []:
            if (config.get("link") or {}).get("rate") != "1gbit":
                continue
            hit = {r["method"]: r for r in config.get("allreduce", []) if r.get("size") == 64 << 20}
            if {"gloo", "hier4"} <= hit.keys():
                hier = hit["hier4"]
                nodes = config.get("nodes") or []
                shape = f"{len(nodes)} nodes of {nodes[0]} ranks" if nodes else "emulated nodes"
                figure = (
                    f"{shape} on {_cores(result)} cores, 64 MiB at 4 bits, two-level: "
                    f"{fmt(hier['time_s'] * 1e3)} ms, {ratio(hier.get('speedup'))} gloo, "
                    f"{ratio(hier.get('over_flat'))} the flat all-reduce"
                )
                return ["Emulated nodes at 1 Gbit/s", figure, _link(result, result.title)]
    return None


def _train_row(results: list[Result]) -> list[str] | None:
    result = _find(results, "train_1gbit") or _find(results, "train")
    by_policy = {r.get("policy"): r for r in (result.data.get("results") or [])} if result else {}
    if not result or not {"none", "static"} <= by_policy.keys():
        return None
    none, static = by_policy["none"], by_policy["static"]
    less = (
        none["bytes_per_step"] / static["bytes_per_step"] if static.get("bytes_per_step") else None
    )
    figure = (
        f"static 4-bit: {fmt(static.get('accuracy'))}% accuracy against "
        f"{fmt(none.get('accuracy'))}% uncompressed, {ratio(less)} fewer bytes per step"
    )
    return ["Same accuracy, fewer bytes", figure, _link(result, result.title)]


def _gpu_row(results: list[Result]) -> list[str] | None:
    result = _find(results, "gpu_codec")
    rows = (
        [r for r in (result.data.get("throughput") or []) if r.get("bits") == 4] if result else []
    )
    if not result or not rows:
        return None
    r = max(rows, key=lambda r: r.get("MiB", 0))
    figure = (
        f"{result.data.get('device', 'GPU')}, {fmt(r.get('MiB'))} MiB: 4-bit encode at "
        f"{fmt(r.get('encode_GBps'))} GB/s ({ratio(r.get('encode_vs_copy'))} a device copy)"
    )
    return ["Codec on the GPU", figure, _link(result, result.title)]


def _listed(
    make: Callable[[list[Result]], list[str] | None],
) -> Callable[[list[Result]], list[list[str]]]:
    return lambda results: [row] if (row := make(results)) else []


#: Headline rows in README order; each gives its rows, none when its result is missing.
HEADLINES: list[Callable[[list[Result]], list[list[str]]]] = [
    _listed(_train_row),
    _link_rows,
    _listed(_nodes_row),
    _listed(_latency_row),
    _listed(_codec_row),
    _listed(_gpu_row),
]
#: Most rows of the headline table.
MAX_HEADLINES = 8


def headline_table(results: list[Result]) -> str:
    """The README's headline table: at most :data:`MAX_HEADLINES` rows, each a claim, its
    current figure and a link to the section of the page that holds it."""
    rows = [row for make in HEADLINES for row in make(results)]
    return table(["claim", "current figure", "page"], rows[:MAX_HEADLINES])


def replace_headline(readme: str, block: str) -> str | None:
    """``readme`` with the text between the headline markers replaced by ``block``; None
    when the README has no markers."""
    start, end = readme.find(HEADLINE_START), readme.find(HEADLINE_END)
    if start < 0 or end < start:
        return None
    head = readme[: start + len(HEADLINE_START)]
    return f"{head}\n{block}\n{readme[end:]}"


def _diff(name: str, old: str, new: str) -> str:
    lines = difflib.unified_diff(
        old.splitlines(keepends=True),
        new.splitlines(keepends=True),
        f"{name} (checked in)",
        f"{name} (rendered)",
    )
    return "".join(lines)


def check(results_root: Path, page: Path, readme: Path | None) -> list[str]:
    """Differences between the files and their rendering (a diff per file; [] when equal)."""
    results = load_results(results_root)
    problems = []
    rendered = render_page(results)
    current = page.read_text() if page.exists() else ""
    if current != rendered:
        problems.append(_diff(str(page), current, rendered))
    for result in results:
        if plots.drawable(result.kind, result.data) and not (page.parent / result.image).exists():
            problems.append(f"{page.parent / result.image}: missing\n")
    if readme is not None and readme.exists():
        text = readme.read_text()
        replaced = replace_headline(text, headline_table(results))
        if replaced is not None and replaced != text:
            problems.append(_diff(str(readme), text, replaced))
    return problems


def write(results_root: Path, page: Path, readme: Path | None, draw: bool = True) -> list[Path]:
    """Render the page (and its plots, unless ``draw`` is False) and the README's headline
    block (when it has the markers); returns the files written."""
    results = load_results(results_root)
    written = []
    text = render_page(results)
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)
    written.append(page)
    if draw:
        keep = set()
        for result in results:
            path = page.parent / result.image
            if plots.save(result.kind, result.data, path):
                keep.add(path)
                written.append(path)
        for stale in (page.parent / IMAGE_DIR).glob("*.png"):
            if stale not in keep and _IMAGE_NAME.fullmatch(stale.name):
                stale.unlink()  # a result's plot whose result is gone
    if readme is not None and readme.exists():
        replaced = replace_headline(readme.read_text(), headline_table(results))
        if replaced is None:
            print(f"{readme}: no {HEADLINE_START} ... {HEADLINE_END} markers, left as is")
        else:
            readme.write_text(replaced)
            written.append(readme)
    return written


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cgx_ucx.bench report", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument(
        "--check", action="store_true", help="compare, write nothing; exit 1 on a difference"
    )
    p.add_argument(
        "--results",
        type=Path,
        default=REPO_ROOT / "benchmarks" / "results",
        help="folder of the machine-class folders of result JSONs",
    )
    p.add_argument(
        "--page", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md", help="page to render"
    )
    p.add_argument(
        "--readme",
        type=Path,
        default=REPO_ROOT / "README.md",
        help="README whose headline table is rendered (between its markers)",
    )
    p.add_argument("--no-plots", action="store_true", help="write the Markdown only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.results.is_dir():
        print(f"no results folder at {args.results}", file=sys.stderr)
        return 2
    if args.check:
        problems = check(args.results, args.page, args.readme)
        for problem in problems:
            print(problem, end="")
        if problems:
            print("the docs differ from the results: run `python -m cgx_ucx.bench report`")
            return 1
        print(f"{args.page} and the README's headline table match {args.results}")
        return 0
    for path in write(args.results, args.page, args.readme, draw=not args.no_plots):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
