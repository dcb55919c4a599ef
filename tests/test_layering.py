"""The layering flows → tasks → focus_core: the library imports no orchestration, tracking or infrastructure, so it
runs in a notebook or another trainer without Prefect, MLflow or this repo's stages."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("prefect", "mlflow", "tasks", "flows", "infra", "prefect_dask", "dask")

SCRIPT = """
import importlib, json, pkgutil, sys
import focus_core
names = [m.name for m in pkgutil.walk_packages(focus_core.__path__, "focus_core.")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "loaded": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def test_importing_all_of_focus_core_loads_no_orchestration_tracking_or_infra():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["modules"]) > 20  # the walk found the library
    assert not set(FORBIDDEN) & set(report["loaded"]), set(FORBIDDEN) & set(report["loaded"])
