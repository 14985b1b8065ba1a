"""The main job's training (examples/train_digits.py): 4 bits as accurate as fp32."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from torch_helpers import run_torch_ranks

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"


def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location("train_digits", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_digits"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _train_job(rank: int, world: int, store: Any) -> Any:
    import torch.distributed as dist

    example = _load_example()
    dist.init_process_group(
        "cgx", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    gloo = dist.new_group(backend="gloo")
    compressed = example.train("cgx", dist.group.WORLD, bits=4, seed=0)
    plain = example.train("plain", gloo, seed=0)
    # Plain dicts: the parent cannot import the example's dataclass by module name.
    return dataclasses.asdict(compressed), dataclasses.asdict(plain)


@pytest.mark.timeout(200)
def test_digits_4bit_matches_fp32_accuracy(tmp_path: Path) -> None:
    results = run_torch_ranks(_train_job, 2, timeout=180)
    compressed, plain = results[0]
    assert plain["accuracy"] > 95.0, plain  # the recipe trains (fixed seeds)
    assert abs(compressed["accuracy"] - plain["accuracy"]) <= 0.5, (compressed, plain)
    # Both ranks end with the same model, hence the same accuracy.
    assert results[1][0]["accuracy"] == compressed["accuracy"]
    assert results[1][1]["accuracy"] == plain["accuracy"]
    assert compressed["bytes_measured"]
    assert compressed["bytes_per_step"] * 5 < plain["bytes_per_step"], (compressed, plain)
    # the curves behind the PNG: a loss per step, and the cgx bytes per step add up
    assert len(compressed["losses"]) == compressed["steps"] == len(compressed["step_bytes"])
    assert plain["step_bytes"] == [] and len(plain["losses"]) == plain["steps"]
    mean_bytes = sum(compressed["step_bytes"]) / compressed["steps"]
    assert int(mean_bytes) == compressed["bytes_per_step"]
    example = _load_example()
    png = example.plot([example.Result(**r) for r in (compressed, plain)], tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
