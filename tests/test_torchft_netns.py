"""torchft across shaped links: ``python -m cgx_ucx.bench ft`` end to end at a small size,
each replica group in its own network namespace (root and iproute2; skipped without them),
per-step DDP only. One group is SIGKILLed mid-run and restarted; it must rejoin, every
group must end at one step with bit-identical parameters, and cgx at 4 bits must put a
fraction of gloo's bytes on the links.

Marked ``slow`` (four runs, 60-100 s on 2 cores): the default run covers kill and rejoin on
loopback (tests/test_torchft_train.py); ``-m slow`` adds the shaped links."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cgx_ucx.bench import netns

pytest.importorskip("torchft")

MISSING = netns.missing_prerequisites()
needs_netns = pytest.mark.skipif(
    bool(MISSING), reason="link emulation needs " + ", ".join(MISSING or ["nothing"])
)


@needs_netns
@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_kill_and_rejoin_across_shaped_links(tmp_path: Path) -> None:
    import subprocess

    argv = [sys.executable, "-m", "cgx_ucx.bench", "ft", "--only", "ddp", "--hidden", "64"]
    argv += ["--steps", "12", "--kill-at", "4", "--timeout", "30", "--out-dir", str(tmp_path)]
    argv += ["--methods", "gloo", "cgx4"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=220)
    assert out.returncode in (0, 1), out.stdout[-3000:] + out.stderr[-3000:]
    record = json.loads((tmp_path / "ft.json").read_text())
    assert record["config"]["netns"] is True
    ddp = record["ddp"]
    assert "torchft+cgx 32-bit" not in ddp and len(ddp) == 4, list(ddp)
    for label, m in ddp.items():
        assert m["ok"], (label, out.stdout[-3000:])
        assert m["same_step"] and m["bit_identical"], (label, m)
        if not label.startswith("reference"):
            assert m["steps_lost"] == 0, (label, m)
            assert m["rejoin_s"] is not None and m["rejoin_s"] < 30, (label, m)
    gloo, cgx4 = ddp["torchft+gloo"], ddp["torchft+cgx 4-bit"]
    # 4-bit codes and per-bucket metadata: well under a third of float32's bytes.
    assert cgx4["link_bytes_per_step"] < gloo["link_bytes_per_step"] / 3, (gloo, cgx4)
    assert abs(cgx4["loss_at_steps"] - gloo["loss_at_steps"]) < 0.01 * gloo["loss_at_steps"]
    # Uninterrupted, every group trains one batch a step: 3 groups, 12 steps.
    ref, ref4 = ddp["reference (gloo, no kill)"], ddp["reference (cgx 4-bit, no kill)"]
    assert ref["batches"] == ref4["batches"] == 3 * 12, (ref, ref4)
    assert cgx4["batches"] < ref4["batches"], cgx4
