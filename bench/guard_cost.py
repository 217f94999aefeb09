"""What the clipping guard costs at a trial start, per shipped model, beside one trial step it protects.

    python bench/guard_cost.py [--models gn_cnn,tanh_cnn,resnet9,wrn16_4]

For each model (auto clipping, the shape of its dataset): the guard's first call in a fresh process (what
a Ray worker pays once per model; later trials hit the cache) and, measured in the same process right after,
one DP step of the mode it chose at the space's physical batch; the ratio says how many steps the guard costs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"gn_cnn": ((1, 8, 8), 256), "tanh_cnn": ((1, 28, 28), 256), "resnet9": ((3, 32, 32), 64),
          "wrn16_4": ((3, 32, 32), 32)}

CHILD = """
import sys, time, torch
sys.path.insert(0, {root!r})
from dptune.config import TrialConfig
from dptune.dpsgd import make_engine
from dptune.dpsgd._guard import guarded_clipping
from dptune.models import build_model
torch.set_num_threads(1)
config = TrialConfig(model={model!r}, clipping="auto", groups=4, batch_size={batch})
t = time.perf_counter(); mode, note = guarded_clipping(config, 10, {shape!r}); guard = time.perf_counter() - t
model = build_model(config, 10, {shape!r}).train()
engine = make_engine(mode, model, config, torch.Generator().manual_seed(0))
x, y = torch.randn(({batch}, *{shape!r})), torch.randint(0, 10, ({batch},))
steps = []
for _ in range(3):
    t = time.perf_counter(); engine.backward(x, y, 0, {batch}); engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True); steps.append(time.perf_counter() - t)
print(mode, guard, min(steps))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(SHAPES))
    args = ap.parse_args()
    root = str(Path(__file__).resolve().parents[1])
    print("| model | mode | guard, first call (s) | one DP step at the physical batch (s) | guard / step |")
    print("|---|---|---|---|---|")
    for model in args.models.split(","):
        shape, batch = SHAPES[model]
        code = CHILD.format(root=root, model=model, shape=shape, batch=batch)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        mode, guard, step = out.split()[-3:]
        print(f"| {model} | {mode} | {float(guard):.2f} | {float(step):.3f} | {float(guard) / float(step):.0f} |")
        time.sleep(0)


if __name__ == "__main__":
    main()
