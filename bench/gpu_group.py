"""Vectorised trials on one GPU (issue 44 goals 2-3; ``bench/gpu_check.sh group``): G trials of one architecture
trained as one computation (``dpsgd.run_group``: whole-model vmap over trials) against the same G trials one at a
time, side by side in one run, without Ray.

    python bench/gpu_group.py --mnist .gpu --out $OUT/gpu_group.json        # on a GPU machine
    python bench/gpu_group.py --smoke --out /tmp/gpu_group.json              # CPU: digits, 2 trials, tiny

NOT PRIVATE (fixed seeds): a throughput and equivalence bench. Per space, G configs of one architecture (the
space's default model and groups; learning rate, batch size, σ and seed differ as the space lets them), epochs
fixed, on ``--device`` (default: cuda when there is one):

- **alone**: each config through ``run_trial`` with the space's own ``clipping`` (``auto``: what a one-at-a-time
  search runs), one after another: wall time, each trial's test accuracy;
- **alone_functorch**: each config alone under the group's engine (``clipping: functorch``);
- **group**: the G configs under ``functorch`` through ``run_group`` (vmapped calls ``--lanes`` wide: the
  accelerator's default ``ACCELERATOR_LANES``, or G on a CPU, whose default is no shared call), wall time (the
  group's guard included) and accuracies, and whether the group's guard let the trials share the computation
  (``shared``; when not, ``refused`` says why and each trial runs its own engine one after another);
- **company**: the first config as a group of one (its calls filled to the same width) against the same config in
  the group of G: max |Δ parameter| after training (0: a trial's numbers do not show its company, and so not K),
  beside the same group of one run twice (``repeat``: the device's own run-to-run difference, 0 where its kernels
  are deterministic);
- **real shape** (``dptune.dpsgd.group_probe``): the group's function at every padded chunk size training has, up
  to ``physical_batch_size`` rows, on synthetic inputs with the trials' own models: max |Δ| of a lane's per-example
  gradients between a call of G lanes and one of 1 (``count``: why calls have a fixed width), the lanes rolled by
  one (``position``) and another lane's examples changed (``company``).

Also: the group's parameters against ``alone_functorch``'s (max |Δ|) and the test-accuracy difference group − alone
(the engine a search runs alone) over the G seeds. Results: a table on stdout, every field in ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from harness.synthetic import write_synthetic_cifar

from dptune.config import SearchSpace, TrialConfig, load_space
from dptune.data import Splits, load_dataset
from dptune.dpsgd import ACCELERATOR_LANES, TrialResult, group_probe, run_group, run_trial

ROOT = Path(__file__).resolve().parents[1]
SEED = 2**100 + 4400  # NOT PRIVATE: the same trials in every arm


def configs(space: SearchSpace, g: int, epochs: float, overrides: dict[str, Any]) -> list[TrialConfig]:
    """G configs of the space's default architecture: lr, batch size and σ spread over the space's ranges."""
    base = space.default.replace(epochs=epochs, score_noise=None, **overrides)
    lr = space.space.get("learning_rate")
    low, high = (lr.low, lr.high) if lr is not None and hasattr(lr, "low") else (base.learning_rate,) * 2
    batch = space.space.get("batch_size")
    batches = list(getattr(batch, "choices", [base.batch_size]))
    out = []
    for i in range(g):
        t = i / max(g - 1, 1)
        out.append(base.replace(learning_rate=low * (high / low) ** t,
                                batch_size=int(batches[i % len(batches)]),
                                noise_multiplier=1.0 + 1.0 * t, seed=SEED + i))
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn: Any, device: str) -> tuple[Any, float]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def _maxdiff(a: TrialResult, b: TrialResult) -> float:
    assert a.model_state is not None and b.model_state is not None
    return max(float((a.model_state[k].float() - b.model_state[k].float()).abs().max()) for k in a.model_state)


def bench_space(name: str, cfgs: list[TrialConfig], data: Splits, device: str, lanes: int | None
                ) -> dict[str, Any]:
    g = len(cfgs)
    lanes = lanes or (ACCELERATOR_LANES if device.startswith("cuda") else g)
    print(f"=== {name}: {g} trials, {cfgs[0].model} groups {cfgs[0].groups}, epochs {cfgs[0].epochs}, "
          f"clipping alone {cfgs[0].clipping}, device {device} {time.strftime('%T')}", flush=True)
    run_trial(cfgs[0].replace(epochs=min(cfgs[0].epochs, 0.05)), data, device=device)  # warm-up: CUDA, cuDNN
    fun = [c.replace(clipping="functorch") for c in cfgs]
    alone, t_alone = _timed(lambda: [run_trial(c, data, device=device, evaluate_test=True, return_model=True)
                                     for c in cfgs], device)
    print(f"  alone ({alone[0].clipping_mode}): {t_alone:.1f} s", flush=True)
    alone_f, t_alone_f = _timed(lambda: [run_trial(c, data, device=device, evaluate_test=True, return_model=True)
                                         for c in fun], device)
    print(f"  alone (functorch): {t_alone_f:.1f} s", flush=True)
    probe = group_probe(fun, data, device=device, lanes_per_call=lanes)
    shared = probe["shared"]
    for row in probe["sizes"]:
        print(f"  {row['rows']:>4} rows: count {row['count']:.2g}, position {row['position']:.2g}, "
              f"company {row['company']:.2g}", flush=True)
    group, t_group = _timed(lambda: run_group(fun, data, device=device, evaluate_test=True, return_model=True,
                                              lanes_per_call=lanes), device)
    print(f"  group ({lanes} lanes per call, shared computation: {shared}): {t_group:.1f} s", flush=True)
    one = run_group(fun[:1], data, device=device, return_model=True, lanes_per_call=lanes)
    again = run_group(fun[:1], data, device=device, return_model=True, lanes_per_call=lanes)  # run-to-run floor
    assert all(isinstance(r, TrialResult) for r in [*alone, *alone_f, *group, *one, *again])
    acc_alone = [float(r.test_accuracy or 0.0) for r in alone]
    acc_group = [float(r.test_accuracy or 0.0) for r in group]
    return {"space": name, "device": device, "trials": g, "lanes_per_call": lanes, "model": cfgs[0].model,
            "groups": cfgs[0].groups, "epochs": cfgs[0].epochs,
            "configs": [{"learning_rate": c.learning_rate, "batch_size": c.batch_size,
                         "noise_multiplier": c.noise_multiplier} for c in cfgs],
            "steps": [r.steps for r in group], "alone_mode": alone[0].clipping_mode,
            "alone_s": t_alone, "alone_functorch_s": t_alone_f, "group_s": t_group, "shared": shared,
            "speedup_vs_alone": t_alone / t_group, "speedup_vs_alone_functorch": t_alone_f / t_group,
            "test_accuracy_alone": acc_alone, "test_accuracy_group": acc_group,
            "accuracy_diff_mean": statistics.fmean(a - b for a, b in zip(acc_group, acc_alone, strict=True)),
            "max_param_diff_group_vs_alone_functorch": max(_maxdiff(a, b) for a, b in zip(group, alone_f,
                                                                                         strict=True)),
            "max_param_diff_company": _maxdiff(group[0], one[0]),
            "max_param_diff_repeat": _maxdiff(one[0], again[0]),  # the device's own run-to-run difference
            "noise_std_over_sigma_c": [float(r.noise_std or 0.0) / (c.noise_multiplier * c.max_grad_norm)
                                       for r, c in zip(group, cfgs, strict=True)],
            "refused": probe["refused"], "real_shape": probe["sizes"]}


def table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'space':<16} {'G':>2} {'alone s':>8} {'functorch s':>11} {'group s':>8} {'shared':>6} "
             f"{'x alone':>7} {'x functorch':>11} {'acc alone':>9} {'acc group':>9} {'Δparam f':>9} "
             f"{'Δcompany':>9} {'Δrepeat':>8} {'Δcount':>11}"]
    for r in results:
        lines.append(f"{r['space']:<16} {r['trials']:>2} {r['alone_s']:>8.1f} {r['alone_functorch_s']:>11.1f} "
                     f"{r['group_s']:>8.1f} {str(r['shared']):>6} {r['speedup_vs_alone']:>7.2f} "
                     f"{r['speedup_vs_alone_functorch']:>11.2f} {statistics.fmean(r['test_accuracy_alone']):>9.4f} "
                     f"{statistics.fmean(r['test_accuracy_group']):>9.4f} "
                     f"{r['max_param_diff_group_vs_alone_functorch']:>9.2g} {r['max_param_diff_company']:>9.2g} "
                     f"{r['max_param_diff_repeat']:>8.2g} "
                     f"{max(s['count'] for s in r['real_shape']):>11.2g}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spaces", nargs="+", default=["mnist", "cifar10_resnet9"],
                    choices=["mnist", "cifar10_resnet9", "digits"])
    ap.add_argument("--mnist", type=Path, default=ROOT.parent / "shared" / "data" / "mnist-t10k")
    ap.add_argument("--trials", type=int, default=5, help="G: trials per group (>= 5: the accuracy comparison)")
    ap.add_argument("--mnist-epochs", type=float, default=2.0)
    ap.add_argument("--cifar-epochs", type=float, default=1.0)
    ap.add_argument("--cifar-per-batch", type=int, default=2000, help="synthetic images per training batch (x5)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lanes", type=int, default=None,
                    help="lanes per vmapped call (default: ACCELERATOR_LANES on cuda, G on a CPU)")
    ap.add_argument("--physical", type=int, default=None,
                    help="physical_batch_size of every trial (default: the space's; a CPU run of ResNet-9 wants 32)")
    ap.add_argument("--smoke", action="store_true", help="CPU: digits only, 2 trials, 0.3 epoch")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.smoke:
        args.spaces, args.trials, args.physical = ["digits"], 2, args.physical or 48
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: list[dict[str, Any]] = []
    meta = {"argv": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}
    with tempfile.TemporaryDirectory(prefix="dptune-gpu-group-") as tmp:
        phys = {"physical_batch_size": args.physical} if args.physical else {}
        for name in args.spaces:
            if name == "mnist":
                space = load_space(ROOT / "search_spaces" / "mnist.yaml")
                data = load_dataset(replace(space.dataset, path=str(args.mnist.resolve())))
                cfgs = configs(space, args.trials, args.mnist_epochs, phys)
            elif name == "cifar10_resnet9":
                folder = write_synthetic_cifar(Path(tmp) / "cifar-10-batches-py", per_batch=args.cifar_per_batch,
                                               n_test=min(2000, args.cifar_per_batch))
                space = load_space(ROOT / "search_spaces" / "cifar10_resnet9.yaml")
                data = load_dataset(replace(space.dataset, path=str(folder), pool_size=5 * args.cifar_per_batch,
                                            validation_size=min(1000, args.cifar_per_batch)))
                cfgs = configs(space, args.trials, args.cifar_epochs, phys)
            else:  # digits: the embedded default (the CPU smoke)
                space = load_space(ROOT / "search_spaces" / "digits.yaml")
                data = load_dataset(space.dataset)
                cfgs = configs(space, args.trials, 0.3 if args.smoke else 2.0, phys)
            results.append(bench_space(name, cfgs, data, args.device, args.lanes))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({**meta, "results": results}, indent=2))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
