"""Run each example briefly, as a user would, so they cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_norm_demo_matches_single_device(tmp_path):
    out = _run("norm_demo.py", cwd=tmp_path)
    error = float(re.search(r"relative error\s*:\s*(\S+)", out).group(1))
    assert error <= 1e-12
    assert re.search(r"collectives for norms \+ clip\s*:\s*1\b", out)


def test_lightning_quickstart_trains_with_lightnings_own_launcher(tmp_path):
    out = _run("lightning_quickstart.py", "--max-steps", "10", "--logdir", str(tmp_path / "runs"), cwd=tmp_path)
    assert "TensorBoard logs:" in out and "summary: final loss" in out
    assert list((tmp_path / "runs" / "quickstart").glob("version_0/events.out.tfevents.*"))


def test_train_gpt_runs_fsdp_x_tp_and_logs(tmp_path):
    out = _run("train_gpt.py", "--max-steps", "4", "--rows", "96", "--logdir", str(tmp_path / "runs"), cwd=tmp_path)
    loss = float(re.search(r"summary: final loss (\S+),", out).group(1))
    assert 0 < loss < 10  # a finite mean cross-entropy over 64 tokens (ln 64 ≈ 4.2 at the start)
    assert list((tmp_path / "runs" / "gpt").glob("version_0/events.out.tfevents.*"))
