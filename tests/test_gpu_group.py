"""Vectorised trials (issue 44; ``bench/gpu_check.sh group``): ``bench/gpu_group.py`` in its CPU smoke mode, the
same code the GPU stage runs, with the shared computation forced on (2 lanes per call; a CPU's default is none).
What it reports must hold here too: the group's function is used, a trial's parameters are the same in a group of
one and in the group (its company does not show), and at every chunk size the bench probes a lane's gradients do
not depend on its place or on the other lanes' examples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.integration


def test_the_group_stage_smoke_run(tmp_path: Path, isolated_env: dict[str, str]) -> None:
    out = tmp_path / "group.json"
    r = subprocess.run([sys.executable, "bench/gpu_group.py", "--smoke", "--out", str(out)], cwd=ROOT,
                       env={**isolated_env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (res,) = json.loads(out.read_text())["results"]
    assert res["device"] == "cpu" and res["trials"] == 2 and res["lanes_per_call"] == 2
    assert res["shared"] and res["refused"] is None
    assert res["max_param_diff_company"] == 0.0  # bitwise: a group of one and the group of two
    assert res["max_param_diff_repeat"] == 0.0  # a CPU's kernels: deterministic
    assert res["max_param_diff_group_vs_alone_functorch"] < 1e-4  # GN-CNN's grouped convolution: rounding only
    assert [s["rows"] for s in res["real_shape"]] == [1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48]  # every size, to the 48-row chunk
    assert all(s["position"] == 0.0 and s["company"] == 0.0 for s in res["real_shape"])
    assert all(s > 0 for s in res["steps"]) and all(abs(v - 1) < 0.05 for v in res["noise_std_over_sigma_c"])
    assert all(0 < a <= 1 for a in res["test_accuracy_alone"] + res["test_accuracy_group"])
    assert "x functorch" in r.stdout and "digits" in r.stdout
