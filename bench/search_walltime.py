"""Wall time of a search's trials, one at a time vs grouped (``--group-trials``), with the same draws, in one run.

Two measurements, each space with a fixed (NOT PRIVATE) bench draw seed:

- trainer: the draw's trials exactly as the search runs them (the space's transfer: σ_c, lr = L·σ_f/σ_c, the
  charge check), at ``--trainer-epochs`` epochs each, in this process at 1 thread: (a) one at a time as
  ``dptune search`` runs them today (``run_trial``, ``clipping: auto``), (b) one at a time with whole-model vmap
  (``clipping: functorch``, the group's engine), (c) all trials of one architecture as one group (``run_group``).
  Checks (c) = (b) bitwise (parameters, score), and measures (c) against (a) (max parameter difference, test
  accuracy of each trial: one seed per trial).
- search: ``dptune search`` itself (a subprocess, local Ray with ``--num-cpus 2``), without and with
  ``--group-trials``: wall time, and the released config, certificate charge and every sealed trial row compared.

    python bench/search_walltime.py [--seed 7] [--trainer-epochs 1] [--device cpu] [--no-search] [--smoke-test]
                                    [--before REV]

The machine is shared (2 cores, other engineers' jobs running): timings carry their load; the result file says
the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness.revisions import checkout, dptune_imported, load_average

ROOT = Path(__file__).resolve().parent.parent
SPACES = ("search_spaces/mnist_scaled.yaml", "search_spaces/mnist.yaml")


def _trial_configs(space_path: str, seed: int, epochs: float | None) -> tuple[Any, list[Any], Any]:
    """The draw's trial configs as ``dptune search --seed`` runs them, and the data."""
    from dptune.accounting import plan_search, plan_transfer, rule_of
    from dptune.config import load_space
    from dptune.data import load_dataset
    from dptune.tuning.draw import make_draw

    space = load_space(ROOT / space_path)
    data = load_dataset(space.dataset)
    n, n_val = len(data.train[1]), len(data.val[1])
    plan = plan_search(space, n, compare=False)
    transfer = plan_transfer(space, plan, final_n=n + n_val) if space.transfers else None
    draw = make_draw(space, rule_of(space.privacy), seed=seed)
    fixed = {k: v for k, v in space.fixed.to_public_dict().items() if k not in space.space}
    configs = []
    for slot in draw.trials:
        from dptune.config import TrialConfig

        cfg = TrialConfig.from_dict({**fixed, **slot["params"], "seed": int(slot["seed"])})
        cfg = transfer.trial_config(cfg) if transfer is not None else cfg
        configs.append(cfg.replace(epochs=epochs) if epochs is not None else cfg)
    return data, configs, plan


def _trainer(space_path: str, seed: int, epochs: float, device: str) -> dict[str, Any]:
    from dptune.dpsgd import TrialResult, architecture_key, run_group, run_trial

    data, configs, _ = _trial_configs(space_path, seed, epochs)
    vmapped = [c.replace(clipping="functorch") for c in configs]
    for c in {architecture_key(c): c for c in configs + vmapped}.values():  # guard probes: once per process
        run_trial(c.replace(epochs=0.01), data, device=device)
    out: dict[str, Any] = {"space": space_path, "k": len(configs), "device": device, "trials": []}
    t, c0 = time.perf_counter(), time.process_time()
    alone = [run_trial(c, data, evaluate_test=True, return_model=True, device=device) for c in configs]
    out["alone_s"], out["alone_cpu"] = time.perf_counter() - t, time.process_time() - c0
    t, c0 = time.perf_counter(), time.process_time()
    alone_vmap = [run_trial(c, data, evaluate_test=True, return_model=True, device=device) for c in vmapped]
    out["alone_vmap_s"], out["alone_vmap_cpu"] = time.perf_counter() - t, time.process_time() - c0
    by_key: dict[Any, list[int]] = {}
    for i, c in enumerate(vmapped):
        by_key.setdefault(architecture_key(c), []).append(i)
    out["groups"] = len(by_key)
    from dptune.dpsgd import guarded_clipping
    from dptune.tuning.grouping import group_clipping

    # (c) as the grouped search runs its members (auto stays the trial's own mode on a CPU, functorch on a GPU)
    as_grouped = [group_clipping(c, lambda x: guarded_clipping(x, data.num_classes, data.input_shape), device)
                  for c in configs]
    runs: dict[str, dict[int, Any]] = {}
    for label, members_of, per_call in (("grouped", as_grouped, None), ("grouped_vmap_all", vmapped, len(configs))):
        runs[label] = {}  # None: run_group's default (one trial per call on a CPU); or every trial in one call
        t, c0 = time.perf_counter(), time.process_time()
        for members in by_key.values():
            results = run_group([members_of[i] for i in members], data, evaluate_test=True, return_model=True,
                                device=device, lanes_per_call=per_call)
            runs[label].update(zip(members, results, strict=True))
        out[f"{label}_s"], out[f"{label}_cpu"] = time.perf_counter() - t, time.process_time() - c0
    grouped = runs["grouped"]
    for i, (a, b) in enumerate(zip(alone, alone_vmap, strict=True)):
        g = grouped[i]
        assert isinstance(g, TrialResult) and g.model_state is not None
        assert a.model_state is not None and b.model_state is not None
        ref = b if as_grouped[i].clipping == "functorch" else a  # (c) runs (b)'s engine on a GPU, (a)'s on a CPU
        bitwise = all(torch.equal(g.model_state[k], ref.model_state[k]) for k in ref.model_state) and (
            g.score == ref.score) and all(torch.equal(runs["grouped_vmap_all"][i].model_state[k], b.model_state[k])
                                          for k in b.model_state) and runs["grouped_vmap_all"][i].score == b.score
        diff = max(float((b.model_state[k] - a.model_state[k]).abs().max()) for k in a.model_state)
        out["trials"].append({"batch_size": configs[i].batch_size, "epochs": configs[i].epochs,
                              "lr": round(configs[i].learning_rate, 4), "sigma": round(configs[i].noise_multiplier, 4),
                              "mode_alone": a.clipping_mode, "group_eq_vmap_alone": bitwise,
                              "max_param_diff_vs_alone": diff, "test_alone": a.test_accuracy,
                              "test_grouped": g.test_accuracy, "score_alone": a.score, "score_grouped": g.score})
    return out


def _search(space_path: str, seed: int, grouped: bool, work: Path, smoke: bool, source: Path | None = None
            ) -> dict[str, Any]:
    """``dptune search`` as a subprocess; ``source``: another checkout's dptune and space file (``--before``)."""
    name = f"{Path(space_path).stem}-{'grouped' if grouped else 'alone'}{'-before' if source else ''}"
    home = work / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "DPTUNE_TEST_DRAW_SEED"}
    env.update(HOME=str(home), PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
    tree = ROOT
    if source is not None:
        # run inside the other revision's tree: ``python -m`` puts the working directory first on sys.path, so a run
        # from ROOT imported this checkout's dptune whatever PYTHONPATH said (before 2026-11-28's fourth session
        # every "before" column here timed this checkout). The spaces' data paths (../shared/...) resolve beside it.
        tree, env["PYTHONPATH"] = source, str(source)
        if not (source.parent / "shared").exists() and (ROOT.parent / "shared").exists():
            (source.parent / "shared").symlink_to(ROOT.parent / "shared")
        if not dptune_imported(source, env).is_relative_to(source.resolve()):
            raise RuntimeError(f"--before: dptune is imported from {dptune_imported(source, env)}, not {source}")
    space_arg = space_path  # relative to the tree the search runs in
    args = [sys.executable, "-m", "dptune.search", "--space", space_arg, "--name", name, "--runs-dir",
            str(work / "runs"), "--ledger", str(work / f"{name}.sqlite"), "--budget-epsilon", "10",
            "--num-cpus", "2", "--seed", str(seed), *(["--group-trials"] if grouped else []),
            *(["--smoke-test"] if smoke and _epochs_fixed(space_path) else [])]
    t = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tree, timeout=7200)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{r.stdout}\n{r.stderr}")
    run = work / "runs" / name
    import pyarrow.parquet as pq

    rows = sorted(pq.read_table(run / "sealed" / "trials.parquet").to_pylist(), key=lambda x: x["index"])
    cert = json.loads((run / "release" / "certificate.json").read_text())
    return {"wall_s": wall, "k": json.loads((run / "sealed" / "draw.json").read_text())["k"],
            "best_config": (run / "release" / "best_config.yaml").read_text(),
            "charge": (cert["epsilon"], cert["delta"], json.dumps(cert["events"], sort_keys=True)),
            "scores": [x["score"] for x in rows], "raw": [x["val_accuracy_raw"] for x in rows]}


def _epochs_fixed(space_path: str) -> bool:
    """--smoke-test overrides the epochs, which a space that searches them refuses: it runs in full."""
    from dptune.config import load_space

    return "epochs" not in load_space(ROOT / space_path).space


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=7, help="the bench draw seed (NOT PRIVATE)")
    ap.add_argument("--spaces", nargs="+", default=list(SPACES))
    ap.add_argument("--trainer-epochs", type=float, default=1.0)
    ap.add_argument("--no-trainer", action="store_true")
    ap.add_argument("--device", default="cpu", help="the trainer measurement's device (cpu, cuda)")
    ap.add_argument("--no-search", action="store_true")
    ap.add_argument("--smoke-test", action="store_true", help="searches at 2 epochs per trial")
    ap.add_argument("--before", metavar="REV", help="also run each search one at a time with this git revision's "
                    "dptune and space file (a worktree in a temporary folder): before vs after, same draws")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "search_walltime.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    result: dict[str, Any] = {"command": "python bench/search_walltime.py " + " ".join(sys.argv[1:]),
                              "load_before": load_average(), "trainer": [], "search": []}
    if not args.no_trainer:
        for s in args.spaces:
            result["trainer"].append(_trainer(s, args.seed, args.trainer_epochs, args.device))
            print(json.dumps(result["trainer"][-1], indent=1, default=str), flush=True)
    if not args.no_search:
        with tempfile.TemporaryDirectory(prefix="dptune-walltime-") as tmp, checkout(args.before) as source:
            for s in args.spaces:
                before = _search(s, args.seed, False, Path(tmp), args.smoke_test, source) if source else None
                alone = _search(s, args.seed, False, Path(tmp), args.smoke_test)
                grouped = _search(s, args.seed, True, Path(tmp), args.smoke_test)
                entry = {"space": s, "k": alone["k"], "alone_s": alone["wall_s"], "grouped_s": grouped["wall_s"],
                         "smoke": args.smoke_test and _epochs_fixed(s),
                         "same_best_config": alone["best_config"] == grouped["best_config"],
                         "same_charge": alone["charge"] == grouped["charge"],
                         "same_scores": alone["scores"] == grouped["scores"],
                         "scores_alone": alone["scores"], "scores_grouped": grouped["scores"],
                         "raw_alone": alone["raw"], "raw_grouped": grouped["raw"],
                         "best_config_alone": alone["best_config"], "best_config_grouped": grouped["best_config"]}
                if before is not None:
                    entry.update(before_rev=args.before, before_s=before["wall_s"], k_before=before["k"],
                                 before_same_best_config=before["best_config"] == alone["best_config"],
                                 before_same_charge=before["charge"] == alone["charge"],
                                 scores_before=before["scores"], raw_before=before["raw"],
                                 best_config_before=before["best_config"], charge_before=before["charge"],
                                 charge_alone=alone["charge"])
                result["search"].append(entry)
                print(json.dumps(entry, indent=1, default=str), flush=True)
                Path(args.out).with_suffix(".partial.json").write_text(json.dumps(result, indent=1, default=str))
    result["load_after"] = load_average()
    out = Path(args.out)
    out.write_text(_markdown(result))
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out} and {out.with_suffix('.json')}")


def _markdown(r: dict[str, Any]) -> str:
    lines = ["# Search wall time: one trial at a time vs grouped (`--group-trials`), same draws", "",
             f"Command: `{r['command']}` (from the repository root). Machine: 2 CPU cores shared with other "
             f"engineers' jobs; load average (1, 5, 15 min) {r['load_before']} before, {r['load_after']} after. "
             "Timings carry that load.", ""]
    if r["trainer"]:
        lines += [f"## Trainer: the draw's trials in one process at 1 thread, on {r['trainer'][0]['device']}", "",
                  "Wall seconds, and in brackets the process's CPU seconds (less sensitive to the other jobs).", "",
                  "| space | K | groups | (a) one at a time, auto | (b) one at a time, functorch | (c) grouped | "
                  "(d) grouped, all trials per call | speedup (c) vs (a) | speedup (c) vs (b) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for t in r["trainer"]:
            lines.append(f"| {t['space']} | {t['k']} | {t['groups']} | {t['alone_s']:.1f} ({t['alone_cpu']:.1f}) | "
                         f"{t['alone_vmap_s']:.1f} ({t['alone_vmap_cpu']:.1f}) | {t['grouped_s']:.1f} "
                         f"({t['grouped_cpu']:.1f}) | {t['grouped_vmap_all_s']:.1f} ({t['grouped_vmap_all_cpu']:.1f}) | "
                         f"{t['alone_s'] / t['grouped_s']:.2f}x "
                         f"({t['alone_cpu'] / t['grouped_cpu']:.2f}x) | {t['alone_vmap_s'] / t['grouped_s']:.2f}x "
                         f"({t['alone_vmap_cpu'] / t['grouped_cpu']:.2f}x) |")
        lines += ["", "Per trial: (c) equals the one-at-a-time run whose engine it runs ((a) on a CPU, (b) on a GPU) and "
                  "(d) = (b), bitwise (parameters and score); (b) against (a) (`auto`, its engine in `mode`): max "
                  "parameter difference and test accuracy.", "",
                  "| space | B | epochs | lr | σ | mode | (c), (d) bitwise | max param diff (b) vs (a) | test alone | "
                  "test grouped |", "|---|---|---|---|---|---|---|---|---|---|"]
        for t in r["trainer"]:
            for x in t["trials"]:
                lines.append(f"| {t['space']} | {x['batch_size']} | {x['epochs']:g} | {x['lr']} | {x['sigma']} | "
                             f"{x['mode_alone']} | {x['group_eq_vmap_alone']} | {x['max_param_diff_vs_alone']:.2e} | "
                             f"{x['test_alone']:.3f} | {x['test_grouped']:.3f} |")
    if r["search"]:
        lines += ["", "## Search: `dptune search --num-cpus 2 --seed S` without and with `--group-trials`", "",
                  "| space | K | one at a time (s) | grouped (s) | speedup | same released config | same charge | "
                  "same sealed scores |", "|---|---|---|---|---|---|---|---|"]
        for e in r["search"]:
            lines.append(f"| {e['space']}{' (--smoke-test: 2 epochs)' if e.get('smoke') else ''} | {e['k']} | "
                         f"{e['alone_s']:.1f} | {e['grouped_s']:.1f} | "
                         f"{e['alone_s'] / e['grouped_s']:.2f}x | {e['same_best_config']} | {e['same_charge']} | "
                         f"{e['same_scores']} |")
        for e in r["search"]:
            lines += ["", f"{e['space']}: sealed scores one at a time {e['scores_alone']}, grouped "
                      f"{e['scores_grouped']}; raw validation accuracy {e['raw_alone']} vs {e['raw_grouped']}."]
        if any("before_s" in e for e in r["search"]):
            lines += ["", "## Before vs after: the same searches one at a time with `--before`'s dptune", "",
                      "| space | before rev | K before / after | before (s) | after, one at a time (s) | after, grouped (s) | "
                      "speedup one at a time | speedup grouped | same released config | same charge |",
                      "|---|---|---|---|---|---|---|---|---|---|"]
            for e in r["search"]:
                if "before_s" in e:
                    lines.append(f"| {e['space']} | {e['before_rev']} | {e['k_before']} / {e['k']} | "
                                 f"{e['before_s']:.1f} | {e['alone_s']:.1f} | {e['grouped_s']:.1f} | "
                                 f"{e['before_s'] / e['alone_s']:.2f}x | {e['before_s'] / e['grouped_s']:.2f}x | "
                                 f"{e['before_same_best_config']} | {e['before_same_charge']} |")
            for e in r["search"]:
                if "before_s" in e:
                    lines += ["", f"{e['space']}: sealed scores before {e['scores_before']}, after "
                              f"{e['scores_alone']}; raw validation accuracy {e['raw_before']} vs {e['raw_alone']}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
