"""benchmarks/device_check.sh, the one call that checks the GPU path on a GPU machine, on
the CPU: every part's command accepts its arguments, a part runs end to end in the dry
run (``slow``: about a minute), and the verdict lines read the results the benchmarks
write."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cgx_ucx.bench import netns

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
MISSING = netns.missing_prerequisites()


def _verdict_module():
    spec = importlib.util.spec_from_file_location(
        "device_verdict", ROOT / "benchmarks" / "device" / "verdict.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    env.pop("CGX_DEVICE_DRY_RUN", None)
    done = subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    return done, out


def _lines(out: Path) -> list[str]:
    return json.loads((out / "device_check.json").read_text())["parts"]


@pytest.mark.timeout(150)
def test_every_part_accepts_its_real_arguments(tmp_path: Path) -> None:
    done, out = _run(tmp_path, "--check-args", timeout=140)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    lines = _lines(out)
    assert [line.split(":")[0] for line in lines] == [
        "PASS part 1 GPU tests and codec",
        "PASS part 2 bench nodes 2x2",
        "PASS part 3 bench link 2 ranks",
        "PASS part 4 DDP peers",
        "PASS part 5 p2p cuda_ipc",
    ]
    assert (out / "device_check.log").read_text().count("+ (arguments)") == 7


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(bool(MISSING), reason="link emulation needs " + ", ".join(MISSING or ["-"]))
@pytest.mark.timeout(150)
def test_dry_run_of_the_link_part_ends_with_its_line(tmp_path: Path) -> None:
    done, out = _run(tmp_path, "--dry-run", "--parts", "3", timeout=140)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    lines = _lines(out)
    assert len(lines) == 1, done.stdout[-3000:]
    # Tiny sizes on a CPU miss the target; the line must still carry the figures.
    assert lines[0].startswith(("PASS part 3 ", "FAIL part 3 ")), lines
    assert "the lower bound" in lines[0] and "(exit" not in lines[0], lines
    results = [p.name for p in out.iterdir() if p.is_dir()]
    assert len(results) == 1 and (out / results[0] / "link.json").is_file(), results
    record = json.loads((out / results[0] / "link.json").read_text())
    assert record["provenance"]["command"].startswith("python -m cgx_ucx.bench link")


def test_verdict_lines_against_the_targets() -> None:
    verdict = _verdict_module()
    ok, text = verdict.part3(
        {
            "configs": [
                {
                    "link": {"rate": "10gbit"},
                    "allreduce": [
                        {"size": 64 << 20, "method": "gloo", "time_s": 0.2, "speedup": 1.0},
                        {
                            "size": 64 << 20,
                            "method": "cgx4",
                            "time_s": 0.014,
                            "bound_s": 0.01,
                            "x_bound": 1.4,
                            "speedup": 14.0,
                        },
                    ],
                }
            ]
        }
    )
    assert ok and "1.40x the lower bound" in text
    hier = {"size": 64 << 20, "method": "hier4", "time_s": 0.09, "over_flat": 1.66}
    hier |= {"speedup": 9.3, "bytes_vs_formula": 1.003, "cpu_s_per_rank": [0.05] * 4}
    ok, text = verdict.part2({"configs": [{"link": {"rate": "1gbit"}, "allreduce": [hier]}]})
    assert not ok and "1.66x flat" in text and "50/50/50/50 CPU-ms per rank" in text
    assert verdict.line("4", 124, None, None).startswith("FAIL part 4 DDP peers: ran past")


def test_ddp_peers_target_needs_every_cgx_variant_ahead_of_every_peer() -> None:
    from cgx_ucx.bench.ddp_peers import summarize

    def row(method: str, step_s: float, loss: float = 1.0, equal: bool = True) -> dict:
        return {
            "method": method,
            "params": 1000,
            "step_s": step_s,
            "tx_bytes_per_step": [4100.0, 4100.0],
            "eval_loss": loss,
            "replicas_equal": equal,
        }

    peers = [row("gloo", 0.8), row("fp16", 0.4), row("powersgd1", 0.1)]
    met = summarize([*peers, row("cgx-backend", 0.09), row("cgx-hook", 0.08, loss=1.005)])
    assert met["met"], met
    slow = summarize([*peers, row("cgx-backend", 0.12), row("cgx-hook", 0.08)])
    assert not slow["met"] and not slow["checks"]["cgx-backend faster than every peer"]
    lossy = summarize([*peers, row("cgx-backend", 0.09), row("cgx-hook", 0.08, loss=1.02)])
    assert not lossy["checks"]["cgx-hook loss within 1%"]
    failed = summarize([*peers, {"method": "cgx-backend", "error": "x"}, row("cgx-hook", 0.08)])
    assert not failed["met"] and "failed: cgx-backend" in failed["text"]
    bypassed = [dict(peers[0], tx_bytes_per_step=[100.0, 100.0]), *peers[1:]]
    assert not summarize([*bypassed, row("cgx-hook", 0.08)])["checks"]["gloo crossed the link"]


def test_powersgd_on_cuda_starts_a_bucket_after_the_previous_one_finished() -> None:
    """Two buckets in flight let two ranks issue PowerSGD's collectives in different
    orders under gloo on CUDA; the wrapper starts a bucket only once the last one is done."""
    import threading

    torch = pytest.importorskip("torch")
    from cgx_ucx.bench.ddp_peers import _one_bucket_at_a_time

    events: list[tuple[str, int]] = []

    def hook(state: object, bucket: int) -> object:
        fut = torch.futures.Future()
        events.append(("start", bucket))

        def finish() -> None:
            events.append(("done", bucket))
            fut.set_result(bucket)

        threading.Timer(0.05, finish).start()
        return fut

    serialized = _one_bucket_at_a_time(hook)
    serialized(None, 0)
    assert serialized(None, 1).wait() == 1
    assert events == [("start", 0), ("done", 0), ("start", 1), ("done", 1)]


_POWERSGD_DDP = """
import os, tempfile
import torch, torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from cgx_ucx.bench.ddp_peers import _one_bucket_at_a_time

store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)),
            bucket_cap_mb=0.01)  # several buckets
state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
model.register_comm_hook(state, _one_bucket_at_a_time(powerSGD_hook.powerSGD_hook))
for step in range(4):
    model(torch.randn(16, 64)).sum().backward()
print("steps", state.iter)
# The DDP reducer holds the group; drop it before the group is destroyed, so that gloo's
# threads are joined here and not during interpreter teardown.
del model, state
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_the_serialized_powersgd_hook_is_accepted_and_runs_under_ddp() -> None:
    pytest.importorskip("torch")
    out = subprocess.run(
        [sys.executable, "-c", _POWERSGD_DDP], capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "steps 4" in out.stdout, out.stdout
