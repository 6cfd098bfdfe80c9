"""scripts/gpu_check.sh --dry-run: the GPU check's steps, on CPU at tiny sizes (what a GPU machine runs, minus the
GPU and the suite's GPU-path files, which the suite runs here), so that the first GPU run is one command that returns
figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    # every step but "tests", which on a GPU runs the suite's GPU-path files (here the suite itself runs them)
    steps = "graph,speed,profile,exact,syncs,race,batching,trace,gather,memory,long,serve"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--contexts", "256",
                        "--batches", "1,2", "--steps", steps, "--serve-clients", "3"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "check.json").read_text())
    assert set(report["steps"]) == {"exact", "race", "syncs", "graph", "batching", "speed",
                                     "profile", "trace", "gather", "memory", "long", "serve"}
    assert all(step["ok"] for step in report["steps"].values())
    speed = report["steps"]["speed"]["rows"]
    assert {r["method"] for r in speed} >= {"full", "offload", "infinigen-0.1", "infinigen-0.05"}
    assert all(r["decode_tok_s"] > 0 for r in speed)
    assert {r.get("fetch") for r in speed if r["method"].startswith("infinigen")} == {"uva", "worker"}
    assert "| method | B | context |" in (tmp_path / "summary.md").read_text()
    profile = report["steps"]["profile"]["rows"]
    assert all(r["step_ms"] > 0 and r["launches_per_step"] == 0 for r in profile.values())  # no GPU: no launches
    gather = report["steps"]["gather"]["rows"]
    assert [(r["batch"], r["sm_share"]) for r in gather] == [(b, s) for b in (1, 2) for s in ("all", 1.0, 0.5, 0.25)]
    assert all(r["step_ms"] > 0 for r in gather)
    trace = report["steps"]["trace"]["rows"]
    assert all(r["host_reads"] == 0 for r in trace.values()) and trace["infinigen"]["extra_per_layer"] > 0
    memory = report["steps"]["memory"]["rows"]
    assert [r["method"] for r in memory] == ["full", "infinigen-0.1", "infinigen-0.1-f32-partial",
                                              "infinigen-0.1-no-mirror"]
    assert all(r["static"] and r["step_ms"] > 0 and r["parts_gib"]["weights"] > 0 for r in memory)
    assert all(r["tokens_equal_bf16_partial"] == 1.0 for r in memory[1:])  # on CPU the same float32 keys
    long = report["steps"]["long"]
    assert long["graph_tokens_equal_eager_b1"] is True
    assert [(r["method"], r["batch"]) for r in long["rows"]] == [
        (m, b) for b in (1, 2) for m in ("full", "offload", "infinigen-0.1", "infinigen-0.05", "infinigen-0.1-int8",
                                         "infinigen-0.05-int8")]
    assert all(r["static"] and r["context"] == 512 and r["step_ms"] > 0 for r in long["rows"])
    assert "Long contexts, filled" in (tmp_path / "summary.md").read_text()
    serve = report["steps"]["serve"]["rows"]
    assert [r["method"] for r in serve] == ["full", "infinigen"]
    assert all(r["completed"] == 3 and r["tokens_per_s"] > 0 and r["ttft_p99_s"] >= r["ttft_p50_s"] > 0 for r in serve)
