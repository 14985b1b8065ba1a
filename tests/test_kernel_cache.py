"""The host codec's kernels: where they are cached, what invalidates the cache, and the
background compile that a connected process uses (the NumPy reference stands in, with the
same bytes, until a kernel is compiled)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numba
import pytest

from cgx_ucx.compression import kernels


def test_cache_dir_precedence(tmp_path: Path) -> None:
    py = f"py{sys.version_info[0]}.{sys.version_info[1]}"
    xdg = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    want = tmp_path / "xdg" / "cgx_ucx" / f"numba-{numba.__version__}-{py}"
    assert kernels.cache_dir(xdg) == want
    assert kernels.cache_dir({**xdg, "NUMBA_CACHE_DIR": "/n"}) == Path("/n")
    env = {**xdg, "NUMBA_CACHE_DIR": "/n", "CGX_UCX_KERNEL_CACHE": "/k"}
    assert kernels.cache_dir(env) == Path("/k")
    home = kernels.cache_dir({"HOME": str(tmp_path)})
    assert home.parent.parent == Path(os.path.expanduser("~")) / ".cache"


def test_gpu_cache_dir_follows_the_same_settings(tmp_path: Path) -> None:
    """The CUDA kernels' cache: in the chosen cache's ``cuda`` folder, else under
    ``XDG_CACHE_HOME`` (``~/.cache`` without it); Numba's own setting does not move it."""
    from cgx_ucx.compression import gpu

    xdg = {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "NUMBA_CACHE_DIR": "/n"}
    assert gpu._cache_dir(xdg) == tmp_path / "xdg" / "cgx_ucx" / "kernels"
    assert gpu._cache_dir({**xdg, "CGX_UCX_KERNEL_CACHE": "/k"}) == Path("/k/cuda")
    assert gpu._cache_dir({}) == Path(os.path.expanduser("~")) / ".cache/cgx_ucx/kernels"


def _module(tmp_path: Path, name: str, source: str) -> types.ModuleType:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    exec(compile(path.read_text(), str(path), "exec"), mod.__dict__)
    return mod


def test_source_digest_ignores_docstrings_and_comments_not_code(tmp_path: Path) -> None:
    base = '''
        """A module."""
        SCALE = 3

        def f(x):
            """Twice."""
            return x * 2  # doubled
    '''
    reworded = '''
        """Another text."""
        SCALE = 3


        def f(x):
            """Two times x."""
            # the product
            return x * 2
    '''
    digest = kernels.source_digest(_module(tmp_path, "a", base))
    assert kernels.source_digest(_module(tmp_path, "b", reworded)) == digest
    assert kernels.source_digest(_module(tmp_path, "c", base.replace("* 2", "* 3"))) != digest
    assert kernels.source_digest(_module(tmp_path, "d", base.replace("= 3", "= 4"))) != digest


_BACKGROUND = """
import json, logging, sys
import numpy as np
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="LOG %(message)s")
from cgx_ucx.compression import cpu, encode, kernels, reference
kernels.compile_in_background()
x = np.random.default_rng(0).standard_normal(kernels.COMPILE_AFTER_VALUES // 2)
x = x.astype(np.float32)
first = encode(x, 4)
after_first = len(cpu._encode_range.dispatcher.signatures)
queued = kernels.wait_compiled(0)  # half the values: nothing queued yet
second = encode(x, 4)  # the threshold: queued
done = kernels.wait_compiled(600)
third = encode(x, 4)  # the kernel
ref = reference.encode(x, 4)
print(json.dumps({
    "same": [bool(np.array_equal(b, ref)) for b in (first, second, third)],
    "idle_before": queued, "done": done, "after_first": after_first,
    "signatures": len(cpu._encode_range.dispatcher.signatures),
    "decode_signatures": len(cpu._decode_range.dispatcher.signatures),
}))
"""


def _run(cache: Path, script: str = _BACKGROUND) -> tuple[dict, str]:
    """Run ``script`` in a fresh process with ``cache`` as its kernel cache: the JSON of its
    last line, and the lines before it."""
    import json

    env = {**os.environ, "CGX_UCX_KERNEL_CACHE": str(cache)}
    env.pop("NUMBA_CACHE_DIR", None)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1])


@pytest.mark.timeout(900)
def test_background_compile_is_bit_identical_and_persists(tmp_path: Path) -> None:
    cache = tmp_path / "kernels"
    result, logs = _run(cache)
    assert result["same"] == [True, True, True]
    assert result["idle_before"] and result["done"]
    assert result["after_first"] == 0  # a cold cache: the first, small call ran the reference
    # Only the signature the calls used: one encode, no decode.
    assert (result["signatures"], result["decode_signatures"]) == (1, 0)
    told = [line for line in logs.splitlines() if "compiled the host codec kernel" in line]
    assert len(told) == 1 and str(cache) in told[0], logs
    assert any(p.suffix == ".nbi" for p in cache.iterdir())
    # A second process (another environment of the same user) loads it: no compile.
    again, logs = _run(cache)
    assert again["same"] == [True, True, True]
    assert again["after_first"] == 1  # a warm cache: the first call loaded the kernel
    assert "compiled the host codec kernel" not in logs
    assert "loaded from the kernel cache" in logs


_LARGE_FIRST_CALL = """
import json
import numpy as np
from cgx_ucx.compression import cpu, encode, kernels, reference
kernels.compile_in_background()
x = np.random.default_rng(1).standard_normal(kernels.COMPILE_AFTER_VALUES).astype(np.float32)
out = encode(x, 4)
print(json.dumps({
    "same": bool(np.array_equal(out, reference.encode(x, 4))),
    "signatures": len(cpu._encode_range.dispatcher.signatures),
}))
"""


@pytest.mark.timeout(900)
def test_a_large_first_call_waits_for_its_kernel_instead_of_the_reference(
    tmp_path: Path,
) -> None:
    result, _ = _run(tmp_path / "kernels", _LARGE_FIRST_CALL)
    assert result == {"same": True, "signatures": 1}


_MANY_SMALL_CALLS = """
import json
import numpy as np
from cgx_ucx.compression import cpu, encode, kernels
kernels.compile_in_background()
x = np.random.default_rng(2).standard_normal(1024).astype(np.float32)
for _ in range(kernels.COMPILE_AFTER_CALLS - 1):
    encode(x, 4)
before = len(cpu._encode_range.dispatcher.signatures)
encode(x, 4)
done = kernels.wait_compiled(600)
print(json.dumps({"before": before, "done": done,
                  "after": len(cpu._encode_range.dispatcher.signatures)}))
"""


@pytest.mark.timeout(900)
def test_many_small_calls_get_their_kernel_compiled(tmp_path: Path) -> None:
    result, _ = _run(tmp_path / "kernels", _MANY_SMALL_CALLS)
    assert result == {"before": 0, "done": True, "after": 1}


def test_source_digest_is_made_once_per_module_one_thread_at_a_time(monkeypatch) -> None:
    """Codec threads ask for a module's digest at once when their kernels first load;
    CPython 3.11's ast.parse fails on two threads at a time ("SystemError: AST
    constructor recursion depth mismatch"), so the digest is made once, under a lock."""
    import threading
    import time
    import types

    from cgx_ucx.compression import kernels

    running, overlaps, made = [0], [0], []

    def slow_digest(module: types.ModuleType) -> str:
        running[0] += 1
        overlaps[0] = max(overlaps[0], running[0])
        time.sleep(0.05)
        made.append(module.__name__)
        running[0] -= 1
        return "d-" + module.__name__

    monkeypatch.setattr(kernels, "_source_digest", slow_digest)
    monkeypatch.setattr(kernels, "_digests", {})
    mods = [types.ModuleType("m1"), types.ModuleType("m2")]
    got: list[str] = []
    threads = [
        threading.Thread(target=lambda m=m: got.append(kernels.source_digest(m))) for m in mods * 4
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(made) == ["m1", "m2"] and overlaps[0] == 1
    assert sorted(got) == ["d-m1"] * 4 + ["d-m2"] * 4


def test_settle_waits_for_the_background_import(monkeypatch):
    """A benchmark's warm-up ends in settle(): it waits for a kernels' import still running
    on its background thread (the warm-up call that started it ran the NumPy reference),
    and says so when that takes longer than its timeout."""
    import threading
    import time

    done = threading.Event()

    def slow_import(seconds: float) -> threading.Thread:
        done.clear()
        t = threading.Thread(target=lambda: (time.sleep(seconds), done.set()), daemon=True)
        t.start()
        return t

    monkeypatch.setattr(kernels, "_host_import", slow_import(0.2))
    kernels.settle(10)
    assert done.is_set()
    monkeypatch.setattr(kernels, "_host_import", slow_import(2.0))
    with pytest.raises(TimeoutError, match="not imported within"):
        kernels.settle(0.1)
