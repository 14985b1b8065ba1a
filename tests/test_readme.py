"""Every ```python block of README.md and docs/*.md runs as pasted, on 2 ranks as torchrun
would run it.

Each block is a complete script. The harness spawns 2 processes with torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set
before anything is imported, and each executes the block's text as ``__main__``. A
fragment that is not a complete script is fenced as ```py instead, and is not run.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import pytest
from harness import RankContext, run_ranks

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
WORLD = 2


def python_blocks(pages: list[Path] = PAGES) -> list[tuple[str, str]]:
    """(id, code) of every ```python block, the id naming the file and line it starts on."""
    out = []
    for page in pages:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{page.relative_to(ROOT)}:{line}", m.group(1)))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_block(ctx: RankContext, name: str, code: str) -> str:
    namespace: dict[str, Any] = {"__name__": "__main__", "__file__": name}
    exec(compile(code, name, "exec"), namespace)
    return "ok"


def test_readme_has_python_blocks() -> None:
    names = [name for name, _ in python_blocks([README])]
    assert len(names) >= 5, names  # torch backend, DDP hook, GradientSync, asyncio, FSDP2


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "code"), python_blocks(), ids=[n for n, _ in python_blocks()])
def test_readme_block_runs_on_two_ranks(name: str, code: str) -> None:
    port = str(_free_port())

    def env(rank: int) -> dict[str, str]:
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "LOCAL_WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
            # the snippets choose their own compression
            "CGX_COMPRESSION_QUANTIZATION_BITS": "",
        }

    assert run_ranks(_run_block, WORLD, args=(name, code), env=env, timeout=280) == ["ok"] * WORLD
