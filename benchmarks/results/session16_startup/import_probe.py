"""Probe (not a command), session 16: seconds to import ml_dtypes (after numpy) in a fresh
interpreter, per version installed with ``pip install --no-deps ml_dtypes==V --target
/tmp/mldN``; five runs each; writes import_probe.json beside this file with the load."""

import json
import os
import subprocess
import sys
from pathlib import Path

CODE = "import time, numpy; t = time.perf_counter(); import ml_dtypes; " + (
    "print(ml_dtypes.__version__, time.perf_counter() - t)"
)
out = {"load_before": os.getloadavg(), "runs": {}}
for target in sys.argv[1:]:
    env = dict(os.environ, PYTHONPATH=target)
    for _ in range(5):
        v, s = subprocess.run(
            [sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        out["runs"].setdefault(v, []).append(float(s))
out["load_after"] = os.getloadavg()
Path(__file__).with_name("import_probe.json").write_text(json.dumps(out, indent=1))
for v, s in out["runs"].items():
    print(f"ml_dtypes {v}: {min(s) * 1e3:.1f}-{max(s) * 1e3:.1f} ms")
print("load", out["load_before"], "->", out["load_after"])
