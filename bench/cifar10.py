"""Accuracy and time of one DP-SGD trial on CIFAR-10 (GPU readiness, issue 7 item 5).

Runs ``dptune.dpsgd.run_trial`` once on a standard ``cifar-10-batches-py`` folder with the defaults of
``search_spaces/cifar10_resnet9.yaml`` (ResNet-9, GroupNorm + Mish + ScaleNorm, NAdam) or
``search_spaces/cifar10_wrn16_4.yaml`` (WRN-16-4, weight standardization, augmult, EMA), and prints
steps/s, examples/s, seconds per epoch (extrapolated), peak memory, test accuracy and the ε of the run.

    python bench/cifar10.py --data data/cifar10 --device cuda --model resnet9 --epochs 40
    python bench/cifar10.py --data data/cifar10 --device cuda --seed-setting        # the seed setting below
    python bench/cifar10.py --data data/cifar10 --steps 20                          # a capped timing run
    python bench/cifar10.py --smoke                                                  # CPU, synthetic, seconds

Seed setting (``--seed-setting``, to record when a GPU is available): ResNet-9 (+ScaleNorm), NAdam
lr 1e-3, batch 1024, δ = 1e-5, σ calibrated by bisection so that the run costs ε = 7.5 for the chosen
number of epochs (default: the space's 40).

``--steps N`` caps the run at N logical steps (sampling rate q = B/n unchanged): the timings are then
extrapolated to a full epoch, the accuracy is that of the short run, and both the ε of the steps actually
run and the ε of the full planned run are printed. The validation split is treated as public here
(nothing is released), so ε is DP-SGD's alone. ``--smoke`` writes a tiny synthetic folder in the real
pickle format (5 x 64 train images, of which 64 are validation, and 64 test images) into a temporary
directory, shrinks the batch to at most n/16 and runs 1 step on the CPU (``--smoke --device cuda``: on the GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness.memory import peak_rss_gib
from harness.synthetic import write_synthetic_cifar

from dptune.accounting import calibrate_noise_multiplier, epsilon, sampling_rate, trial_event, trial_steps
from dptune.config import DatasetSpec, TrialConfig, load_space
from dptune.data import load_dataset
from dptune.dpsgd import resolve_clipping, run_trial
from dptune.models import build_model, count_parameters

ROOT = Path(__file__).resolve().parents[1]  # the repository: its space files

SPACES = {"resnet9": ROOT / "search_spaces" / "cifar10_resnet9.yaml",
          "wrn16_4": ROOT / "search_spaces" / "cifar10_wrn16_4.yaml"}
SEED_SETTING: dict[str, Any] = {"model": "resnet9", "target_epsilon": 7.5, "batch_size": 1024, "optimizer": "nadam",
                "learning_rate": 1e-3, "delta": 1e-5}
SMOKE_VAL, SMOKE_STEPS = 64, 1


def pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: no CUDA device is available (use --device cpu or auto)")
    return name


def device_name(dev: str) -> str:
    if dev == "cuda":
        return f"cuda ({torch.cuda.get_device_name(0)})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)"


def peak_memory(dev: str) -> tuple[str, float]:
    if dev == "cuda":
        return "cuda_max_memory_allocated", torch.cuda.max_memory_allocated() / 2**30
    return "rss_peak", peak_rss_gib()


def build_config(args: argparse.Namespace, n_train: int) -> tuple[TrialConfig, dict[str, Any]]:
    """The trial config from the space's defaults and the command line; info holds the planned run."""
    cfg = load_space(SPACES[args.model]).default.replace(score_noise=None, seed=args.seed)
    changes: dict[str, Any] = {}
    if args.seed_setting:
        changes.update(batch_size=SEED_SETTING["batch_size"], optimizer=SEED_SETTING["optimizer"],
                       learning_rate=SEED_SETTING["learning_rate"], momentum=0.0)
    for key in ("epochs", "batch_size", "physical_batch_size", "noise_multiplier", "learning_rate", "optimizer",
                "groups", "augmult", "ema_decay", "max_grad_norm", "clipping", "scale_norm"):
        value = getattr(args, key)
        if value is not None:
            changes[key] = float(value) if key == "epochs" else value
    cfg = cfg.replace(**changes)
    if args.smoke:  # a tiny folder: keep q = B/n small and physical batches cheap
        b = min(cfg.batch_size, max(1, n_train // 16))
        cfg = cfg.replace(batch_size=b, physical_batch_size=min(cfg.physical_batch_size, max(b, 16)))
    q = sampling_rate(batch_size=cfg.batch_size, basis=n_train)
    t_full = trial_steps(epochs=cfg.epochs, batch_size=cfg.batch_size, basis=n_train)
    target = SEED_SETTING["target_epsilon"] if args.seed_setting else args.target_epsilon
    if target is not None:
        if args.noise_multiplier is not None:
            raise SystemExit("error: --noise-multiplier and a target ε (--target-epsilon/--seed-setting) exclude "
                             "each other")
        sigma = calibrate_noise_multiplier([], sampling_rate=q, steps=t_full, delta=args.delta,
                                           target_epsilon=float(target))  # bisection on ε(σ)
        cfg = cfg.replace(noise_multiplier=sigma)
    cap = SMOKE_STEPS if args.smoke and args.steps is None else args.steps
    steps = t_full if cap is None else min(cap, t_full)
    run_cfg = cfg if steps == t_full else cfg.replace(epochs=steps * cfg.batch_size / n_train)
    assert trial_steps(epochs=run_cfg.epochs, batch_size=run_cfg.batch_size, basis=n_train) == steps
    info = {"q": q, "steps_full": t_full, "steps_planned": steps, "target_epsilon": target,
            "epsilon_full": epsilon([trial_event(noise_multiplier=cfg.noise_multiplier, sampling_rate=q, steps=t_full,
                                                 score_noise=None)], args.delta)}
    return run_cfg, info


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="folder holding cifar-10-batches-py (or that folder itself)")
    ap.add_argument("--smoke", action="store_true", help="synthetic tiny CIFAR folder, 1 step, CPU")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--model", choices=tuple(SPACES), default="resnet9")
    ap.add_argument("--seed-setting", action="store_true",
                    help="ResNet-9, ε 7.5 (σ calibrated), batch 1024, NAdam lr 1e-3, δ 1e-5")
    ap.add_argument("--epochs", type=float, help="default: the space's (resnet9 40, wrn16_4 50)")
    ap.add_argument("--batch-size", type=int, help="logical (expected Poisson) batch size")
    ap.add_argument("--physical-batch-size", type=int, help="examples per forward/backward (memory)")
    ap.add_argument("--noise-multiplier", type=float, help="σ (default: the space's default σ)")
    ap.add_argument("--target-epsilon", type=float, help="calibrate σ so the full run costs this ε")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--steps", type=int, help="cap on logical steps (smoke/timing runs)")
    ap.add_argument("--learning-rate", "--lr", dest="learning_rate", type=float)
    ap.add_argument("--optimizer", choices=("sgd", "nadam", "adam"))
    ap.add_argument("--groups", type=int)
    ap.add_argument("--augmult", type=int)
    ap.add_argument("--ema-decay", type=float)
    ap.add_argument("--max-grad-norm", type=float)
    ap.add_argument("--clipping", choices=("auto", "bookkeeping", "hooks", "functorch", "ghost"))
    ap.add_argument("--scale-norm", action=argparse.BooleanOptionalAction, default=None,
                    help="ResNet-9 ScaleNorm (default: on, as in the space)")
    ap.add_argument("--validation-size", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0, help="trial seed (benchmark only: NOT PRIVATE)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    if args.seed_setting and args.model != "resnet9":
        ap.error("--seed-setting is the ResNet-9 setting; drop --model or use --model resnet9")
    if not args.smoke and not args.data:
        ap.error("--data PATH is required (or --smoke)")
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be >= 1")
    return args


def run(args: argparse.Namespace, data_path: Path) -> dict[str, Any]:
    dev = "cpu" if args.smoke and args.device == "auto" else pick_device(args.device)  # smoke: CPU unless asked
    val_size = SMOKE_VAL if args.smoke else args.validation_size
    data = load_dataset(DatasetSpec(name="cifar10", path=str(data_path), validation_size=val_size,
                                    public_validation=True))
    n = len(data.train[1])
    cfg, info = build_config(args, n)
    params = count_parameters(build_model(cfg, data.num_classes, data.input_shape))
    print(f"device: {device_name(dev)}")
    print(f"model: {cfg.model}{' +ScaleNorm' if cfg.model == 'resnet9' and cfg.scale_norm else ''} "
          f"({params:,} params), clipping {resolve_clipping(cfg, n)}, groups {cfg.groups}")
    print(f"data: {n} train / {len(data.val[1])} validation / {len(data.test[1])} test"
          f"{' (synthetic smoke folder)' if args.smoke else ''}")
    print(f"config: B={cfg.batch_size} physical={cfg.physical_batch_size} sigma={cfg.noise_multiplier:.4f} "
          f"C={cfg.max_grad_norm} {cfg.optimizer} lr={cfg.learning_rate:g} augmult={cfg.augmult} "
          f"ema={cfg.ema_decay} q={info['q']:.5f} delta={args.delta:g}"
          + (f" (sigma calibrated to epsilon {info['target_epsilon']:g})" if info["target_epsilon"] else ""))
    print(f"planned: {info['steps_full']} steps = {info['steps_full'] * cfg.batch_size / n:.2f} epochs; "
          f"running {info['steps_planned']} steps")
    sys.stdout.flush()

    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    marks: list[float] = []
    t0 = time.perf_counter()
    result = run_trial(cfg, data, device=dev, evaluate_test=True,
                       on_epoch=lambda e, m: marks.append(time.perf_counter()))
    if dev == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    train_s = (marks[-1] if marks else time.perf_counter()) - t0  # up to the end of the last epoch, no eval
    mem_kind, mem_gib = peak_memory(dev)
    steps_per_epoch = n / cfg.batch_size
    out = {
        "device": device_name(dev), "model": cfg.model, "params": params, "clipping": result.clipping_mode,
        "batch_size": cfg.batch_size, "physical_batch_size": cfg.physical_batch_size,
        "noise_multiplier": cfg.noise_multiplier, "learning_rate": cfg.learning_rate, "optimizer": cfg.optimizer,
        "delta": args.delta, "sampling_rate": info["q"], "steps": result.steps, "steps_full": info["steps_full"],
        "train_seconds": train_s, "total_seconds": total,
        "steps_per_s": result.steps / train_s, "examples_per_s": result.steps * cfg.batch_size / train_s,
        "seconds_per_epoch": train_s / max(result.steps, 1) * steps_per_epoch,
        "peak_memory_gib": mem_gib, "peak_memory_kind": mem_kind,
        "test_accuracy": result.test_accuracy, "val_accuracy": result.val_accuracy_raw,
        "diverged": result.diverged,
        "epsilon": epsilon([trial_event(noise_multiplier=cfg.noise_multiplier, sampling_rate=info["q"],
                                        steps=max(result.steps, 1), score_noise=None)], args.delta),
        "epsilon_full": info["epsilon_full"],
    }
    out["seconds_full_run_extrapolated"] = out["seconds_per_epoch"] * info["steps_full"] / steps_per_epoch
    return out


def report(out: dict[str, Any]) -> None:
    print(f"steps: {out['steps']} of {out['steps_full']}")
    print(f"train_seconds: {out['train_seconds']:.2f} (total with init and evaluation {out['total_seconds']:.2f})")
    print(f"steps_per_s: {out['steps_per_s']:.3f}")
    print(f"examples_per_s: {out['examples_per_s']:.1f} (expected logical examples)")
    print(f"seconds_per_epoch: {out['seconds_per_epoch']:.1f} (extrapolated; full run "
          f"{out['seconds_full_run_extrapolated'] / 60:.1f} min)")
    print(f"peak_memory: {out['peak_memory_gib']:.2f} GiB ({out['peak_memory_kind']})")
    print(f"test_accuracy: {out['test_accuracy']:.4f}{' (DIVERGED)' if out['diverged'] else ''}")
    print(f"epsilon: {out['epsilon']:.3f} at delta {out['delta']:g} for the {out['steps']} steps run; "
          f"epsilon_full: {out['epsilon_full']:.3f} for all {out['steps_full']} steps")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="dptune-cifar-smoke-") as tmp:
            out = run(args, write_synthetic_cifar(Path(tmp) / "cifar-10-batches-py"))
    else:
        out = run(args, Path(args.data))
    report(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 1 if out["diverged"] or not math.isfinite(out["epsilon"]) else 0


if __name__ == "__main__":
    sys.exit(main())
