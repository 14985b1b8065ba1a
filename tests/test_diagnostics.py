"""cgx_ucx.describe(): the bug-report summary (versions, UCX transports, GPU, variables)."""

from __future__ import annotations

import io
import subprocess
import sys

import cgx_ucx
from cgx_ucx import diagnostics


def test_describe_reports_versions_transports_gpu_and_environment(monkeypatch):
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "4")
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    out = io.StringIO()
    info = cgx_ucx.describe(out)
    v = info["versions"]
    assert v["cgx_ucx"] == cgx_ucx.__version__
    assert v["python"] == ".".join(map(str, sys.version_info[:3]))
    for name in ("numpy", "numba", "ucxx"):
        assert v[name], name
    # UCX itself, from the libucx wheel's ucx_info
    assert v["UCX"] and v["UCX"][0].isdigit(), info["ucx"]
    names = {t["transport"] for t in info["ucx"]["transports"]}
    assert {"tcp", "self"} <= names, info["ucx"]
    assert info["environment"] == {
        k: val
        for k, val in info["environment"].items()
        if k.startswith(("CGX_", "UCX_")) or k in diagnostics.RELATED_ENV
    }
    assert info["environment"]["UCX_TLS"] == "tcp,self"
    assert "UNRELATED_VARIABLE" not in info["environment"]
    assert info["compression_from_environment"].startswith("bits=4 ")
    gpu = info["gpu"]
    assert isinstance(gpu["devices"], int) and gpu["devices"] >= 0
    if not gpu["cupy_installed"]:
        assert not gpu["cupy_importable"] and gpu["error"]
    text = out.getvalue()
    assert text == diagnostics.format_report(info) + "\n"
    assert "UCX transports" in text and "CGX_COMPRESSION_QUANTIZATION_BITS=4" in text


def test_describe_never_raises_on_a_bad_variable(monkeypatch):
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "5x")
    info = cgx_ucx.describe(quiet=True)
    assert "CGX_COMPRESSION_QUANTIZATION_BITS='5x'" in info["compression_from_environment"]


def test_missing_ucx_info_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(diagnostics.importlib.util, "find_spec", lambda name: None)
    info = diagnostics.describe(quiet=True)
    assert info["ucx"]["transports"] == [] and "not installed" in info["ucx"]["error"]
    assert info["versions"]["UCX"] is None
    assert not info["gpu"]["cupy_installed"]


def test_runs_from_a_shell():
    proc = subprocess.run(
        [sys.executable, "-m", "cgx_ucx.diagnostics"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("cgx_ucx diagnostics")


def test_the_secret_is_never_printed(monkeypatch):
    """The report is meant for bug reports: CGX_UCX_SECRET is masked (review)."""
    from cgx_ucx import diagnostics

    monkeypatch.setenv("CGX_UCX_SECRET", "hunter2")
    env = diagnostics._environment()
    assert env["CGX_UCX_SECRET"] != "hunter2" and "hunter2" not in repr(env)
