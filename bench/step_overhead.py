"""Step-time overhead of DP-SGD over non-private SGD, per clipping mode, measured interleaved.

    python bench/step_overhead.py [--quick] [--threads N] [--no-memory]

For each model the non-private step and the DP step of every mode run round-robin in one process (so
machine noise hits all alike); the table shows median DP time / median non-private time. Also the
peak RSS of a ResNet-9 DP step at physical batch 64 (in a fresh subprocess, so earlier runs don't count).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dptune.config import TrialConfig
from dptune.data import Splits
from dptune.dpsgd import init_model, make_engine

MODES = ("hooks", "functorch", "ghost", "bookkeeping")


def _fake_splits(shape: tuple[int, int, int], n: int = 8) -> Splits:
    x, y = torch.zeros(n, *shape), torch.zeros(n, dtype=torch.long)
    return Splits((x, y), (x, y), (x, y), 10, shape)


def _timer(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_model(model_name: str, shape: tuple[int, int, int], batch: int, reps: int) -> dict[str, float]:
    cfg = TrialConfig(model=model_name, batch_size=batch, physical_batch_size=max(batch * 2, 64),
                      clipping="hooks", noise_multiplier=1.0, groups=16 if model_name != "gn_cnn" else 4)
    data = _fake_splits(shape, n=batch)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *shape, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)

    plain = init_model(cfg, data)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)

    def plain_step() -> None:
        sgd.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x), y).backward()
        sgd.step()

    steps: dict[str, Callable[[], None]] = {"non-private": plain_step}
    for mode in MODES:
        model = init_model(cfg, data)
        engine = make_engine(mode, model, cfg, torch.Generator().manual_seed(1))

        def dp_step(engine: object = engine) -> None:
            assert hasattr(engine, "backward")
            engine.backward(x, y, 0)  # type: ignore[attr-defined]
            engine.optimizer.step()  # type: ignore[attr-defined]
            engine.optimizer.zero_grad(set_to_none=True)  # type: ignore[attr-defined]

        steps[mode] = dp_step
    for fn in steps.values():  # warm-up (allocator, vmap tracing)
        fn()
        fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(reps):
        for k, fn in steps.items():
            times[k].append(_timer(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def peak_rss_child() -> None:
    cfg = TrialConfig(model="resnet9", batch_size=64, physical_batch_size=64, groups=16, clipping="functorch")
    data = _fake_splits((3, 32, 32), n=64)
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    out = {}
    for mode in ("bookkeeping", "hooks"):
        engine = make_engine(mode, init_model(cfg, data), cfg, torch.Generator())
        engine.backward(x, y, 0)
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)
        out[mode] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(" ".join(f"{k}={v:.2f}" for k, v in out.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few repetitions (smoke test)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-memory", action="store_true", help="skip the ResNet-9 peak-RSS measurement")
    ap.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        peak_rss_child()
        return
    cases = [("gn_cnn", (1, 8, 8), 256, 30 if not args.quick else 5),
             ("resnet9", (3, 32, 32), 32, 8 if not args.quick else 2)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ratio = DP step / non-private step")
    print(f"{'model':10} {'B':>4} {'non-private ms':>15} " + " ".join(f"{m:>10}" for m in MODES))
    for name, shape, batch, reps in cases:
        med = bench_model(name, shape, batch, reps)
        base = med["non-private"]
        print(f"{name:10} {batch:>4} {base * 1e3:>15.1f} " + " ".join(f"{med[m] / base:>9.2f}x" for m in MODES))
    if not args.no_memory:
        out = subprocess.run([sys.executable, __file__, "--rss-child"], capture_output=True, text=True, check=True)
        print("ResNet-9 DP step, physical batch 64, peak RSS GiB (cumulative over modes):", out.stdout.strip())


if __name__ == "__main__":
    main()
