"""``import cgx_ucx`` leaves torch unimported, and the ``cgx`` backend is registered
whichever of the two a script imports first (each case in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def _run(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_leaves_torch_unimported_and_registers_once_torch_is():
    got = _run(
        "import json, sys, cgx_ucx\n"
        "before = 'torch' in sys.modules\n"
        "import torch.distributed as dist\n"
        "print(json.dumps({'before': before, 'cgx': 'cgx' in dist.Backend.backend_list,\n"
        "    'hooks': [type(f).__name__ for f in sys.meta_path if 'After' in type(f).__name__]}))"
    )
    assert got == {"before": False, "cgx": True, "hooks": []}


def test_torch_imported_first_registers_at_import():
    got = _run(
        "import json, torch.distributed as dist\n"
        "had = 'cgx' in dist.Backend.backend_list\n"
        "import cgx_ucx\n"
        "print(json.dumps({'had': had, 'cgx': 'cgx' in dist.Backend.backend_list}))"
    )
    assert got == {"had": False, "cgx": True}


def test_a_spec_looked_up_first_does_not_use_up_the_hook():
    # importlib.util.find_spec("torch") asks every finder, ours included, and imports
    # nothing: the import that follows must still register the backend.
    got = _run(
        "import importlib.util, json, sys, cgx_ucx\n"
        "assert importlib.util.find_spec('torch') is not None\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
        "import torch.distributed as dist\n"
        "print(json.dumps({'cgx': 'cgx' in dist.Backend.backend_list}))"
    )
    assert got == {"cgx": True}


def test_reexported_torch_names_import_the_integration_on_use():
    got = _run(
        "import json, sys, cgx_ucx\n"
        "from cgx_ucx import CGXOptions, GradientSync, cgx_hook\n"
        "import torch.distributed as dist\n"
        "print(json.dumps({'names': [CGXOptions.__name__, GradientSync.__name__,\n"
        "    cgx_hook.__name__], 'module': cgx_ucx.torch.__name__,\n"
        "    'cgx': 'cgx' in dist.Backend.backend_list,\n"
        "    'listed': all(n in dir(cgx_ucx) for n in cgx_ucx.__all__)}))"
    )
    assert got == {
        "names": ["CGXOptions", "GradientSync", "cgx_hook"],
        "module": "cgx_ucx.torch",
        "cgx": True,
        "listed": True,
    }


def test_a_broken_integration_warns_and_does_not_break_import_torch():
    # sys.modules[name] = None makes importing that module fail with ImportError.
    got = _run(
        "import json, sys, warnings, cgx_ucx\n"
        "sys.modules['cgx_ucx.torch'] = None\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import torch\n"
        "try:\n"
        "    cgx_ucx.GradientSync\n"
        "    raised = None\n"
        "except ImportError as exc:\n"
        "    raised = type(exc).__name__\n"
        "print(json.dumps({'torch': torch.tensor([1.0]).sum().item(), 'raised': raised,\n"
        "    'warned': [str(w.message) for w in caught if w.category is RuntimeWarning]}))"
    )
    assert got["torch"] == 1.0
    assert got["raised"] == "ModuleNotFoundError"
    assert len(got["warned"]) == 1 and "'cgx' torch.distributed backend" in got["warned"][0]
