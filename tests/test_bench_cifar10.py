"""bench/cifar10.py: the smoke run (synthetic CIFAR-format folder, real ResNet-9 DP-SGD step on CPU)."""

from __future__ import annotations

import importlib.util
import math
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from dptune.accounting import epsilon, trial_event
from dptune.config import DatasetSpec
from dptune.data import load_dataset

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "cifar10.py"
FIELDS = ("device", "model", "steps", "train_seconds", "steps_per_s", "examples_per_s", "seconds_per_epoch",
          "peak_memory", "test_accuracy", "epsilon")


def _bench() -> ModuleType:
    """bench/cifar10.py as ``python bench/cifar10.py`` imports it (bench/ on sys.path: its ``harness``)."""
    spec = importlib.util.spec_from_file_location("bench_cifar10", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH.parent))
    return module


def _field(out: str, name: str) -> str:
    m = re.search(rf"^{name}: (\S+)", out, re.MULTILINE)
    assert m, f"{name!r} missing from:\n{out}"
    return m.group(1)


@pytest.mark.integration  # make test-slow (CI runs it): the CIFAR-10 bench end to end, ~14 s
def test_smoke_run_prints_every_field(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    res = subprocess.run([sys.executable, str(BENCH), "--smoke", "--threads", "1", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    for name in FIELDS:
        _field(out, name)
    assert _field(out, "device") == "cpu"
    assert _field(out, "steps") == "1"
    for name in ("steps_per_s", "examples_per_s", "seconds_per_epoch", "peak_memory"):
        assert float(_field(out, name)) > 0
    assert 0.0 <= float(_field(out, "test_accuracy")) <= 1.0
    assert "2,448,714 params" in out  # ResNet-9 + ScaleNorm, as in the space
    # ε of the 1 step run: q = 16/256, σ = the space's default 1.5, public validation
    assert float(_field(out, "epsilon")) == pytest.approx(epsilon([trial_event(noise_multiplier=1.5, sampling_rate=16 / 256, steps=1, score_noise=None)], 1e-5),
                                                          abs=1e-3)
    assert (tmp_path / "r.json").is_file()


def test_synthetic_folder_is_real_cifar_format(tmp_path: Path) -> None:
    folder = _bench().write_synthetic_cifar(tmp_path / "cifar-10-batches-py", per_batch=8, n_test=6)
    raw = pickle.loads((folder / "data_batch_3").read_bytes())
    assert raw["data"].shape == (8, 3072) and raw["data"].dtype.name == "uint8" and len(raw["labels"]) == 8
    s = load_dataset(DatasetSpec(name="cifar10", path=str(tmp_path), validation_size=4))
    assert (len(s.train[1]), len(s.val[1]), len(s.test[1])) == (36, 4, 6)
    assert s.input_shape == (3, 32, 32) and s.num_classes == 10


def test_seed_setting_calibrates_sigma_to_epsilon_7_5(tmp_path: Path) -> None:
    bench = _bench()
    args = bench.parse_args(["--data", str(tmp_path), "--seed-setting", "--epochs", "10", "--steps", "3"])
    n = 45_000  # real CIFAR-10 train split (50,000 - 5,000 validation)
    cfg, info = bench.build_config(args, n)
    assert (cfg.model, cfg.batch_size, cfg.optimizer, cfg.learning_rate) == ("resnet9", 1024, "nadam", 1e-3)
    assert info["steps_full"] == math.ceil(10 * n / 1024) and info["steps_planned"] == 3
    assert info["epsilon_full"] == pytest.approx(7.5, rel=5e-3) and info["epsilon_full"] <= 7.5
    assert epsilon([trial_event(noise_multiplier=cfg.noise_multiplier * 0.99, sampling_rate=1024 / n, steps=info["steps_full"], score_noise=None)], 1e-5) > 7.5
