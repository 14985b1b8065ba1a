"""Result provenance and the rendered benchmark docs: every JSON written through
``write_json`` carries its provenance, and the checked-in page (and the README's headline
table) equal what ``python -m cgx_ucx.bench report`` renders from benchmarks/results/."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

import pytest

from cgx_ucx.bench import pages, plots, provenance, report, sections
from cgx_ucx.bench.__main__ import BENCHMARKS, TOOLS

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PAGE = REPO / "docs" / "benchmarks.md"
README = REPO / "README.md"

#: A result as benchmarks wrote it before results carried provenance.
OLD_CONTENTION = {
    "benchmark": "contention",
    "machine": {"host": "vm", "python": "3.11.7", "cpus": 2, "time": "2026-11-30T11:23:09+0000"},
    "args": {"world": 2, "hogs": 8, "steps": 150, "repeats": 2},
    "summary": {
        "gloo": {"quiet_ms": 8.2, "hog_ms": 37.3, "slowdown": 4.55},
        "cgx4": {"quiet_ms": 13.3, "hog_ms": 100.5, "slowdown": 7.57},
        "cgx_vs_gloo_slowdown": 1.66,
    },
}


def test_checked_in_page_equals_rendering():
    rendered = pages.render_page(pages.load_results(RESULTS))
    assert PAGE.read_text() == rendered, "run `python -m cgx_ucx.bench report`"


def test_checked_in_page_has_its_plots():
    for result in pages.load_results(RESULTS):
        if plots.drawable(result.kind, result.data):
            assert (PAGE.parent / result.image).is_file(), result.image


def test_readme_headline_equals_rendering():
    text = README.read_text()
    replaced = pages.replace_headline(text, pages.headline_table(pages.load_results(RESULTS)))
    if replaced is None:
        pytest.skip("README.md has no headline markers")
    assert text == replaced, "run `python -m cgx_ucx.bench report`"


def test_results_tree_holds_machine_classes_only():
    """benchmarks/results/ holds one folder per machine class and nothing else."""
    for entry in RESULTS.iterdir():
        assert entry.is_dir(), entry
        assert re.fullmatch(r"[a-z0-9]+-\d+core", entry.name), entry.name
        assert not [p for p in entry.iterdir() if p.is_dir()], entry


def test_write_json_records_provenance(tmp_path):
    path = report.write_json("probe", {"figure": 1.0}, tmp_path)
    data = json.loads(path.read_text())
    assert data["benchmark"] == "probe" and data["figure"] == 1.0
    prov = data["provenance"]
    assert set(prov) >= {
        "command",
        "git",
        "date",
        "host",
        "libraries",
        "load_before",
        "load_after",
        "machine_class",
    }
    assert prov["command"].startswith("python")
    if (REPO / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}", prov["git"]["commit"])
        assert isinstance(prov["git"]["dirty"], bool)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", prov["date"])
    assert set(prov["host"]) >= {"cpu", "logical_cores", "memory_gib", "gpus"}
    assert prov["host"]["logical_cores"] == os.cpu_count()
    libraries = prov["libraries"]
    assert set(libraries) >= {"python", "cgx_ucx", "torch", "numpy", "numba", "ucxx", "libucx"}
    assert "cupy" in libraries  # None where it is not installed
    assert libraries["numpy"] and libraries["cgx_ucx"]
    for load in (prov["load_before"], prov["load_after"]):
        assert load is None or (len(load) == 3 and all(v >= 0 for v in load))
    assert prov["machine_class"] == provenance.machine_class()


@pytest.mark.parametrize(
    "cores,gpus,expected",
    [
        (2, [], "cpu-2core"),
        (16, ["NVIDIA H200"], "h200-16core"),
        (8, ["NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB"], "a100-8core"),
        (32, ["NVIDIA GeForce RTX 4090"], "rtx4090-32core"),
        (4, ["Tesla V100-PCIE-16GB"], "v100-4core"),
    ],
)
def test_machine_class(cores, gpus, expected):
    assert provenance.machine_class(cores, gpus) == expected


def test_machine_class_of_this_machine():
    kind = "cpu" if not provenance.gpus() else None
    name = provenance.machine_class()
    assert name.endswith(f"-{os.cpu_count()}core")
    assert kind is None or name.startswith(kind)


def test_command_line_names_the_benchmark_command():
    bench = REPO / "cgx_ucx" / "bench"
    run = provenance.command_line
    assert run([str(bench / "__main__.py"), "codec", "--sizes", "1"]) == (
        "python -m cgx_ucx.bench codec --sizes 1"
    )
    assert run([str(bench / "link.py"), "--rates", "1gbit"]) == (
        "python -m cgx_ucx.bench link --rates 1gbit"
    )
    assert run(["/usr/local/bin/cgx-bench", "nodes"]) == "python -m cgx_ucx.bench nodes"
    assert run([str(REPO / "benchmarks" / "gpu_check.py"), "--out", "a b"]) == (
        "python benchmarks/gpu_check.py --out 'a b'"
    )


def test_refresh_tracked_writes_the_machine_class_folder():
    args = argparse.Namespace(refresh_tracked=True, out_dir=None)
    assert report.results_dir(args) == report.tracked_results_dir() / provenance.machine_class()
    assert report.results_dir(argparse.Namespace(out_dir="x")) == Path("x")


def test_result_without_provenance_renders():
    page = pages.render_page([pages.Result("cpu-2core", "contention", OLD_CONTENTION)])
    assert "Command: not recorded." in page
    assert "Provenance: not recorded (written 2026-11-30T11:23:09+0000, 2 cores" in page
    assert "| cgx4 | 13.3 | 100 | 7.57x |" in page


def test_result_with_provenance_names_command_commit_and_load(tmp_path):
    path = report.write_json("contention", dict(OLD_CONTENTION), tmp_path)
    data = json.loads(path.read_text())
    page = pages.render_page([pages.Result("cpu-2core", "contention", data)])
    prov = data["provenance"]
    assert f"Command: `{prov['command']}`" in page
    assert f"commit `{prov['git']['commit'][:10]}`" in page
    assert "Provenance: not recorded" not in page
    assert " before, " in page and " after; " in page


def test_git_state_counts_code_changes_not_the_benchmark_outputs(tmp_path):
    """A refreshed result, docs page or README does not make the next result's code
    "uncommitted"; a changed source file does, and is named (in the page too)."""
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    for path in ("cgx_ucx/a.py", "benchmarks/results/cpu-2core/x.json", "docs/b.md", "README.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("one\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    state = provenance.git_state(tmp_path)
    assert state is not None and state["dirty"] is False and state["changed"] == []
    for path in ("benchmarks/results/cpu-2core/x.json", "docs/b.md", "README.md"):
        (tmp_path / path).write_text("two\n")
    (tmp_path / "untracked.py").write_text("new\n")
    state = provenance.git_state(tmp_path)
    assert state is not None and state["dirty"] is False and state["changed"] == []
    (tmp_path / "cgx_ucx/a.py").write_text("two\n")
    state = provenance.git_state(tmp_path)
    assert state is not None and state == {**state, "dirty": True, "changed": ["cgx_ucx/a.py"]}
    line = sections.provenance_line({"provenance": {"git": state, "date": "d"}})
    assert "(uncommitted changes to `cgx_ucx/a.py`)" in line


def test_unknown_benchmark_renders_without_a_table():
    page = pages.render_page([pages.Result("cpu-2core", "mystery", {"benchmark": "mystery"})])
    assert "### mystery (cpu-2core)" in page
    assert "no table for this benchmark" in page


def test_headline_rows_link_to_sections():
    results = pages.load_results(RESULTS)
    table = pages.headline_table(results)
    rows = table.splitlines()[2:]
    assert 0 < len(rows) <= pages.MAX_HEADLINES
    page = PAGE.read_text()
    anchors = {pages.anchor(line[4:]) for line in page.splitlines() if line.startswith("### ")}
    for row in rows:
        target = re.search(r"\(docs/benchmarks\.md#([^)]+)\)", row)
        assert target and target[1] in anchors, row


def test_check_and_write(tmp_path, capsys):
    results = tmp_path / "results" / "cpu-2core"
    results.mkdir(parents=True)
    (results / "contention.json").write_text(json.dumps(OLD_CONTENTION))
    page = tmp_path / "docs" / "benchmarks.md"
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{pages.HEADLINE_START}\nold\n{pages.HEADLINE_END}\n\nrest\n")
    argv = ["--results", str(tmp_path / "results"), "--page", str(page), "--readme", str(readme)]

    assert pages.main([*argv, "--check"]) == 1
    assert "(rendered)" in capsys.readouterr().out

    assert pages.main(argv) == 0
    assert pages.check(tmp_path / "results", page, readme) == []
    assert pages.main([*argv, "--check"]) == 0
    assert "old" not in readme.read_text() and readme.read_text().endswith("\n\nrest\n")

    page.write_text(page.read_text().replace("13.3", "12.0"))
    assert pages.main([*argv, "--check"]) == 1
    assert "-| cgx4 | 12.0" in capsys.readouterr().out


def test_readme_without_markers_is_left_alone(tmp_path):
    results = tmp_path / "results" / "cpu-2core"
    results.mkdir(parents=True)
    (results / "contention.json").write_text(json.dumps(OLD_CONTENTION))
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    pages.write(tmp_path / "results", tmp_path / "benchmarks.md", readme, draw=False)
    assert readme.read_text() == "# no markers\n"


def test_report_is_a_command_not_a_benchmark():
    assert "report" in TOOLS and "report" not in BENCHMARKS
