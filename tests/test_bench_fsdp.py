"""``python -m cgx_ucx.bench link --fsdp``: FSDP2 over the emulated link, gloo against cgx with
a compressed gradient reduce-scatter. Its bytes model and refusals, and its smallest case end
to end (root and iproute2; skipped without them)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from cgx_ucx.bench import netns
from cgx_ucx.bench.link import main
from cgx_ucx.bench.link_checks import fsdp_bytes_model, verify_fsdp
from cgx_ucx.compression import encoded_nbytes

MISSING = netns.missing_prerequisites()
needs_netns = pytest.mark.skipif(
    bool(MISSING), reason="link emulation needs " + ", ".join(MISSING or ["nothing"])
)
MIB = 1 << 20
PARAMS = 1_000_000


def test_bytes_model() -> None:
    # 2 ranks: each all-gather and the reduce-scatter send half of the parameters' bytes.
    assert fsdp_bytes_model(PARAMS, 2, 32, 2.0, 1024) == 1.5 * 4 * PARAMS
    c = encoded_nbytes(PARAMS, 4, 1024)
    assert fsdp_bytes_model(PARAMS, 2, 4, 2.0, 1024) == 0.5 * (8 * PARAMS + c)
    assert fsdp_bytes_model(PARAMS, 4, 4, 1.0, 1024) == pytest.approx(0.75 * (4 * PARAMS + c))


def _row(method: str, tx: float | None, loss: float = 2.0) -> dict:
    bits = 32 if method == "gloo" else int(method[3:])
    row = {
        "method": method,
        "backend": "gloo" if method == "gloo" else "cgx",
        "bits": bits,
        "params": PARAMS,
        "tx_bytes_per_step": tx,
        "eval_loss": loss,
        "eval_loss_per_rank": [loss, loss],
        "loss_vs_gloo": loss / 2.0 - 1,
    }
    if method != "gloo":
        row["cgx_collectives_per_step"] = {"allgather": 8.0, "reduce_scatter": 4.0}
    return row


def _honest() -> list[dict]:
    full = fsdp_bytes_model(PARAMS, 2, 32, 2.0, 1024)
    small = fsdp_bytes_model(PARAMS, 2, 4, 2.0, 1024)
    return [_row("gloo", 1.3 * full), _row("cgx4", small, 2.001), _row("cgx32", full)]


def test_honest_rows_pass_and_record_the_saving() -> None:
    rows = _honest()
    assert verify_fsdp(rows, 2, 1024) == []
    cgx4 = rows[1]
    assert cgx4["tx_saved_vs_cgx32"] == pytest.approx(
        rows[2]["tx_bytes_model"] - cgx4["tx_bytes_model"]
    )
    # Without cgx32 the compressed run is held against gloo.
    assert verify_fsdp(_honest()[:2], 2, 1024) == []
    # Outside the emulator (no device counters) only the loss and routing checks apply.
    blind = _honest()
    for row in blind:
        row["tx_bytes_per_step"] = None
    assert verify_fsdp(blind, 2, 1024) == []


def test_refusals() -> None:
    rows = _honest()
    rows[2]["tx_bytes_per_step"] = rows[1]["tx_bytes_per_step"] + 1000  # nothing saved
    assert "were not compressed" in verify_fsdp(rows, 2, 1024)[0]

    rows = _honest()
    rows[1].update(eval_loss=2.1, eval_loss_per_rank=[2.1, 2.1], loss_vs_gloo=0.05)
    assert "from gloo's" in verify_fsdp(rows, 2, 1024)[0]
    rows = _honest()
    rows[2].update(eval_loss=2.01, eval_loss_per_rank=[2.01, 2.01], loss_vs_gloo=0.005)
    assert "tolerance 0.10%" in verify_fsdp(rows, 2, 1024)[0]  # 32 bits must match gloo

    rows = _honest()
    rows[1]["eval_loss_per_rank"] = [2.001, 2.002]
    assert "different or non-finite" in verify_fsdp(rows, 2, 1024)[0]

    rows = _honest()
    rows[1]["cgx_collectives_per_step"] = {"allgather": 8.0}
    assert any("no reduce_scatter" in v for v in verify_fsdp(rows, 2, 1024))

    rows = _honest()
    rows[0]["tx_bytes_per_step"] = 0.1 * rows[0]["tx_bytes_per_step"]
    assert "traffic went elsewhere" in verify_fsdp(rows[:2], 2, 1024)[0]


def test_bad_fsdp_bits_exit_2() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--fsdp", "--fsdp-bits", "33"])
    assert exc.value.code == 2


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


@needs_netns
@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smallest_fsdp_case_end_to_end(tmp_path: Path) -> None:
    """2 ranks at 1 Gbit/s, a narrow MLP, a few FSDP2 steps on gloo, cgx4 and cgx32: no
    refusal, the losses agree, cgx4 sent less than cgx32 and gloo by about what the model
    says, and the reduce-scatters went through cgx."""
    before = _namespaces()
    args = ["--world", "2", "--rates", "1gbit", "--sizes", "1", "--bits", "4"]
    args += ["--min-iters", "1", "--max-iters", "1", "--budget", "0", "--probe-seconds", "0.3"]
    args += ["--fsdp", "--steps", "2", "--warmup", "1", "--hidden", "256"]
    assert main([*args, "--out-dir", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "link.json").read_text())
    (config,) = record["configs"]
    assert config["violations"] == []
    rows = {r["method"]: r for r in config["fsdp"]}
    assert set(rows) == {"gloo", "cgx4", "cgx32"}
    assert rows["gloo"]["steps"] == 2 and len(rows["gloo"]["loss_curve_rank0"]) == 3
    assert rows["cgx32"]["eval_loss"] == pytest.approx(rows["gloo"]["eval_loss"], rel=1e-3)
    assert rows["cgx4"]["eval_loss"] == pytest.approx(rows["gloo"]["eval_loss"], rel=0.02)
    assert rows["cgx4"]["cgx_collectives_per_step"]["reduce_scatter"] > 0
    for name in ("cgx4", "cgx32"):  # the device's bytes are cgx's own count plus TCP's
        r = rows[name]
        assert 0.95 * r["tx_bytes_model"] <= r["tx_bytes_per_step"] <= 1.2 * r["tx_bytes_model"]
        assert r["cgx_bytes_sent_per_step"] <= r["tx_bytes_per_step"]
    assert rows["cgx4"]["tx_bytes_per_step"] < 0.9 * rows["cgx32"]["tx_bytes_per_step"]
    assert rows["cgx4"]["tx_bytes_per_step"] < rows["gloo"]["tx_bytes_per_step"]
    assert any(line["case"].startswith("FSDP2 training 4 bits") for line in record["headline"])
    assert _namespaces() == before
