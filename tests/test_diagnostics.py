"""cgx_ucx.describe(): the bug-report summary (versions, UCX transports, GPU, variables)."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

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


def test_describe_never_raises_and_names_every_bad_variable(monkeypatch):
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "5x")
    monkeypatch.setenv("CGX_UCX_TIMEOUT", "-1")
    monkeypatch.setenv("CGX_COMPRESSION_BUCKET_SIZE", "0")
    monkeypatch.setenv("CGX_CROSS_REDUCTION_TYPE", "tree")
    monkeypatch.setenv("CGX_INTRA_COMPRESS", "x")
    info = cgx_ucx.describe(quiet=True)
    assert info["compression_from_environment"].startswith("not resolved")
    problems = " ".join(info["environment_problems"])
    for name in (
        "QUANTIZATION_BITS='5x'",
        "TIMEOUT='-1'",
        "BUCKET_SIZE='0'",
        "TYPE='tree'",
        "INTRA_COMPRESS='x'",
    ):
        assert name in problems, problems
    assert len(info["environment_problems"]) == 5
    text = diagnostics.format_report(info)
    assert text.count("    bad: ") == 5 and "bad CGX_* variables: 5" in text


def test_validate_environment_names_every_bad_variable():
    from cgx_ucx.config import validate_environment

    env = {"CGX_COMPRESSION_QUANTIZATION_BITS": "9", "CGX_COMPRESSION_STOCHASTIC": "2"}
    with pytest.raises(cgx_ucx.ConfigError, match="2 bad variables") as info:
        validate_environment(env)
    assert "BITS='9'" in str(info.value) and "STOCHASTIC='2'" in str(info.value)


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
    assert "RuntimeWarning" not in proc.stderr, proc.stderr


def test_the_secret_is_never_printed(monkeypatch):
    """The report is meant for bug reports: CGX_UCX_SECRET is masked."""
    from cgx_ucx import diagnostics

    monkeypatch.setenv("CGX_UCX_SECRET", "hunter2")
    env = diagnostics._environment()
    assert env["CGX_UCX_SECRET"] != "hunter2" and "hunter2" not in repr(env)
