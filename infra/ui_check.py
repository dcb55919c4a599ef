"""The Prefect UI as a user sees it: a run started from the train form, its page screenshotted in headless Chromium.

    python -m infra.ui_check --out bench/out/ui      # ~3 minutes; needs Debian's `chromium` (apt install chromium)

Starts a Prefect server and `focus serve` on loopback (state under a temporary folder), starts a one-iteration
GRPO run of `focus-train/default` through the REST call the UI's Run button makes (the typed form's settings plus
overrides that make it small), waits for it, then screenshots the flow run's page (its Logs tab) and its
learning-curve artifact. Prints one JSON line: the flow run, its state, how many of its log lines are FOCUS stage lines,
its artifact keys and the PNGs. Exit 2, with one line, where Chromium is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from infra.services import focus_serve, start_prefect
from infra.services import prefect_api as api
from infra.services import wait_for as wait

SMALL = ["env.eval_tasks=3", "model.layers=1", "model.hidden=32", "model.heads=2", "model.intermediate=64",
         "model.vocab_size=400", "bootstrap.demonstrations=12", "bootstrap.epochs=1", "agent.max_turns=5",
         "budget.prompts_per_iteration=2", "budget.group_size_grpo=4", "budget.measure_episodes=8", "ppo.epochs=1"]


def screenshot(browser: str, url: str, path: Path) -> None:
    subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1500,1100", "--virtual-time-budget=20000", f"--screenshot={path}", url],
                   check=True, capture_output=True, timeout=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/out/ui", help="folder for the screenshots")
    args = parser.parse_args(argv)
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("ui_check: no chromium on PATH (fix: apt install chromium)", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="focus-ui-") as tmp:
        root = Path(tmp)
        server = start_prefect(root / "services")
        base = server.env["PREFECT_API_URL"]
        serving = focus_serve(server, root, str(root / "runs"))
        try:
            deployment = wait(lambda: api(base, "/deployments/name/focus-train/default"), 180, "the deployment")
            flow_run = api(base, f"/deployments/{deployment['id']}/create_flow_run", {"parameters": {
                "settings": {"method": "grpo", "env": "legal", "iterations": 1, "seed": 3},
                "overrides": SMALL, "run_id": "ui-check"}})
            state = wait(lambda: api(base, f"/flow_runs/{flow_run['id']}")["state_type"] in
                         ("COMPLETED", "FAILED", "CRASHED") and api(base, f"/flow_runs/{flow_run['id']}")["state_type"],
                         900, "the flow run")
            logs = api(base, "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run["id"]]}}, "limit": 200})
            artifacts = api(base, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}})
            ui = base.removesuffix("/api")
            curve = next(a["id"] for a in artifacts if a.get("key") == "learning-curve")
            pages = {"logs": f"{ui}/runs/flow-run/{flow_run['id']}",  # the Logs tab opens first
                     "learning_curve": f"{ui}/artifacts/artifact/{curve}"}
            shots = {}
            for name, url in pages.items():
                shots[name] = str(out / f"flow_run_{name}.png")
                screenshot(browser, url, Path(shots[name]))
        finally:
            os.killpg(serving.pid, signal.SIGTERM)
            serving.wait(timeout=30)
            server.stop()
    stage_lines = [entry["message"] for entry in logs if entry["message"].startswith("[it ")]
    print(json.dumps({"flow_run": flow_run["id"], "state": state, "log_lines": len(logs),
                      "stage_lines": len(stage_lines), "first_stage_line": stage_lines[0] if stage_lines else None,
                      "artifacts": sorted(a["key"] for a in artifacts if a.get("key")), "screenshots": shots}))
    return 0 if state == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
