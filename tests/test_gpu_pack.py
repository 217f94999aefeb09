"""Trials packed on a GPU (issue 44 goal 3): ``--gpus-per-trial`` is refused before anything is charged where the
GPUs are not there, and ``bench/gpu_pack.py`` (``bench/gpu_check.sh pack``) runs here in its smoke mode: Ray told
of one logical GPU packs two 0.25-GPU trials at once and runs 1-GPU trials one after the other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dptune
from dptune.ledger import Ledger
from dptune.tuning.options import RayOptions, check_gpus
from tests.conftest import digits_seed_with_k, run_cli

ROOT = Path(__file__).resolve().parent.parent
MNIST = ROOT.parent / "shared" / "data" / "mnist-t10k"
DIGITS = ROOT / "search_spaces" / "digits.yaml"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")


@pytest.mark.parametrize("value, num_gpus, words", [
    ("abc", None, "is not a number"), ("-1", None, "not a number >= 0"), ("1.5", 1, "above 1 but not whole"),
    ("0.25", 0, "has no GPU"), ("1", 0, "has no GPU"), ("2", 1, "this machine's Ray has 1"),
])
def test_gpus_per_trial_that_cannot_be_granted_is_refused(value: str, num_gpus: int | None, words: str) -> None:
    with pytest.raises(dptune.ConfigError) as e:
        check_gpus(RayOptions(gpus_per_trial=value, num_gpus=num_gpus))
    assert e.value.field == "--gpus-per-trial" and words in e.value.problem
    check_gpus(RayOptions(gpus_per_trial="0.25", num_gpus=1))  # four per GPU: fine
    check_gpus(RayOptions(gpus_per_trial="auto", num_gpus=0))  # auto on no GPU: CPU trials


@no_cuda
def test_a_fraction_of_a_gpu_on_a_machine_without_one_exits_2_before_any_charge(tmp_path: Path) -> None:
    """Before: the flag was checked only once Ray had started and the search was charged (then aborted)."""
    r = run_cli(["-m", "dptune.search", "--space", str(DIGITS), "--ledger", str(tmp_path / "l.sqlite"),
                 "--budget-epsilon", "30", "--runs-dir", str(tmp_path / "runs"), "--name", "g",
                 "--seed", str(digits_seed_with_k(2, 4)), "--gpus-per-trial", "0.25"],
                {**os.environ, "HOME": str(tmp_path)})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: --gpus-per-trial: 0.25 GPU(s) per trial requested" in r.stderr
    assert "--gpus-per-trial 0" in r.stderr  # the fix
    assert "Ray started" not in r.stdout and not (tmp_path / "runs" / "g").exists()
    assert not (tmp_path / "l.sqlite").exists() or Ledger(tmp_path / "l.sqlite").charges() == []


def _bench_module() -> object:
    import importlib.util

    sys.path.insert(0, str(ROOT / "bench"))  # as ``python bench/gpu_pack.py`` runs it: its harness package
    try:
        spec = importlib.util.spec_from_file_location("bench_gpu_pack", ROOT / "bench" / "gpu_pack.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return module


def test_the_bench_spaces_are_the_repositorys_run_n_trials(tmp_path: Path) -> None:
    """The two spaces the GPU stage measures, as the bench edits them: each plans exactly N trials (composed)."""
    bench = _bench_module()
    mnist = bench.mnist_space(tmp_path, 8, 2.0)  # type: ignore[attr-defined]
    cifar = bench.cifar_space(tmp_path, 10000, 4, 0.5, False)  # type: ignore[attr-defined]
    assert mnist["model"]["name"] == "tanh_cnn" and cifar["model"]["name"] == "resnet9"
    assert "pool_size" not in cifar["dataset"]  # the full 50,000: CIFAR-10's own size
    for space, n, trials in ((mnist, 8000, 8), (cifar, 45000, 4)):
        plan = dptune.plan(space, n_train=n)
        assert plan.stopping.label().startswith(f"composed({trials}")
    assert bench.max_concurrent([(0, 2), (1, 3), (3, 4)]) == 2  # type: ignore[attr-defined]
    assert bench.max_concurrent([(0, 1), (1, 2)]) == 1  # type: ignore[attr-defined]


@pytest.mark.integration  # the bench's pack stage end to end, ~50 s (make test-slow; CI runs it)
@pytest.mark.skipif(not (MNIST / "t10k-images-idx3-ubyte.gz").exists(), reason="needs ../shared/data/mnist-t10k")
def test_the_pack_stage_smoke_run_packs_trials_on_one_gpu(tmp_path: Path, isolated_env: dict[str, str]) -> None:
    out = tmp_path / "pack.json"
    r = subprocess.run([sys.executable, "bench/gpu_pack.py", "--smoke", "--spaces", "mnist", "--mnist", str(MNIST),
                        "--out", str(out)], cwd=ROOT, env={**isolated_env, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    arms = {a["gpus_per_trial"]: a for a in json.loads(out.read_text())["results"]}
    assert set(arms) == {1.0, 0.25}
    for a in arms.values():
        assert a["space"] == "mnist" and a["trials"] == 2 and a["devices"] == ["cpu"] and a["trials_per_gpu_hour"] > 0
    assert arms[1.0]["max_concurrent"] == 1  # a whole GPU each: one after the other
    assert arms[0.25]["max_concurrent"] == 2  # a quarter each: both at once on the one GPU
    assert arms[1.0]["steps"] == arms[0.25]["steps"]  # the same draw in both arms
    assert "trials/GPU-h" in r.stdout and "mnist: packed 0.25/one =" in r.stdout
