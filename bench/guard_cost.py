"""What the clipping guard costs at a trial start, per shipped model, beside one trial step it protects.

    python bench/guard_cost.py [--models gn_cnn,tanh_cnn,resnet9,wrn16_4] [--baseline DIR]

For each model (auto clipping, the shape of its dataset): the guard's first call in a fresh process (what
a Ray worker pays once per model; later trials hit the cache) and, measured in the same process right after,
one DP step of the mode it chose at the space's physical batch; the ratio says how many steps the guard costs.
``--baseline DIR``: the same measurement of another checkout of dptune (e.g. a ``git worktree`` of an earlier
commit) in the same run, model by model, and the ratio of the two guards.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {"gn_cnn": ((1, 8, 8), 256), "tanh_cnn": ((1, 28, 28), 256), "resnet9": ((3, 32, 32), 64),
          "wrn16_4": ((3, 32, 32), 32)}


def child(model: str) -> None:
    """In a fresh process: the guard's first call for ``model``, then the best of 3 DP steps of the mode it chose."""
    import torch

    from dptune.config import TrialConfig
    from dptune.dpsgd import guarded_clipping, make_engine
    from dptune.models import build_model

    torch.set_num_threads(1)
    shape, batch = SHAPES[model]
    config = TrialConfig(model=model, clipping="auto", groups=4, batch_size=batch)
    t = time.perf_counter()
    mode, _ = guarded_clipping(config, 10, shape)
    guard = time.perf_counter() - t
    net = build_model(config, 10, shape).train()
    engine = make_engine(mode, net, config, torch.Generator().manual_seed(0))
    x, y = torch.randn((batch, *shape)), torch.randint(0, 10, (batch,))
    steps = []
    for _ in range(3):
        t = time.perf_counter()
        engine.backward(x, y, 0, batch)
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)
        steps.append(time.perf_counter() - t)
    print(mode, guard, min(steps))


def _measure(model: str, repo: Path) -> tuple[str, float, float]:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    out = subprocess.run([sys.executable, __file__, "--child", model], capture_output=True, text=True, check=True,
                         cwd=repo, env=env).stdout
    mode, guard, step = out.split()[-3:]
    return mode, float(guard), float(step)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--baseline", type=Path, help="another checkout of dptune, measured beside this one")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    here = Path(__file__).resolve().parents[1]
    extra = " | baseline guard (s) | guard / baseline" if args.baseline else ""
    print(f"| model | mode | guard, first call (s) | one DP step at the physical batch (s) | guard / step{extra} |")
    print("|---|---|---|---|---|" + ("---|---|" if args.baseline else ""))
    for model in args.models.split(","):
        mode, guard, step = _measure(model, here)
        row = f"| {model} | {mode} | {guard:.2f} | {step:.3f} | {guard / step:.0f} |"
        if args.baseline:
            _, base, _ = _measure(model, args.baseline.resolve())
            row += f" {base:.2f} | {guard / base:.1f} |"
        print(row)


if __name__ == "__main__":
    main()
