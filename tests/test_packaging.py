"""Packaging: the wheel ships kernels/*.cu; torch is a range, pinned by the scripts."""

import configparser
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_wheel_ships_kernels_and_all_packages(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("cgx_ucx-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "kernels").glob("*.cu"))
    assert sources, "kernels/ holds no CUDA source"
    for name in sources:
        assert f"cgx_ucx/kernels/{name}" in names
    assert "cgx_ucx/py.typed" in names
    # Every package of the source tree is in the wheel (setup.cfg lists them by hand).
    for init in (ROOT / "cgx_ucx").rglob("__init__.py"):
        rel = init.relative_to(ROOT).as_posix()
        assert rel in names, f"{rel} missing from the wheel: add its package to setup.cfg"


def _extras() -> dict[str, list[str]]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    section = cfg["options.extras_require"]
    return {name: [r.strip() for r in section[name].splitlines() if r.strip()] for name in section}


def test_package_declares_a_torch_range_and_the_scripts_pin_it():
    """Exact pins belong to the project's set-up (scripts/constraints.txt), not to the
    package metadata: a library that pins torch fights the user's own torch."""
    (torch_req,) = [r for r in _extras()["torch"] if r.startswith("torch")]
    assert "==" not in torch_req and ">=" in torch_req and "<" in torch_req, torch_req
    pins = [
        line.split("#")[0].strip()
        for line in (ROOT / "scripts" / "constraints.txt").read_text().splitlines()
    ]
    (pin,) = [p for p in pins if p.startswith("torch==")]
    # the pin lies inside the declared range
    from packaging.requirements import Requirement

    assert Requirement(torch_req).specifier.contains(pin.split("==")[1]), (torch_req, pin)
    setup = (ROOT / "scripts" / "setup_env.sh").read_text()
    assert "-c " in setup and "constraints.txt" in setup


def test_cupy_is_only_in_the_gpu_extra():
    """A CPU machine's environment holds no CuPy: only the gpu extra names it, and the
    set-up installs that extra only where a GPU is found (or CGX_UCX_GPU=1)."""
    extras = _extras()
    assert any(r.startswith("cupy") for r in extras["gpu"])
    for name, reqs in extras.items():
        if name != "gpu":
            assert not any(r.startswith("cupy") for r in reqs), name
    setup = (ROOT / "scripts" / "setup_env.sh").read_text()
    assert "nvidia-smi -L" in setup and "CGX_UCX_GPU" in setup
