"""`pip install .` (not only editable) must ship the CUDA sources of kernels/ in the wheel."""

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
