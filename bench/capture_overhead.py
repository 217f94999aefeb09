"""What capturing a model costs a DP step: the captured program (what trains since issue 59) against the same model's
own Python, side by side in one process.

    python bench/capture_overhead.py [--reps N] [--threads N] [--models M ...] [--out FILE]

For each shipped model and the clipping mode ``auto`` picks for it, one engine on the captured program and one on
the user's Python module (the same weights), each timing a DP step (one engine backward on a padded physical batch
of B rows, then the optimizer's noise and update) round-robin, so machine noise hits both alike. The table shows
the median step time of each and the median of the paired ratios captured / Python with its quartiles. A ratio
above 1 is what capture costs; the graph's own Python is fx's generated code, so it should be 1 within noise."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from dptune.config import TrialConfig
from dptune.dpsgd import checked_model, make_engine, padded_size, resolve_clipping
from dptune.models import build_model

MODELS = {"gn_cnn": ((1, 8, 8), 64), "tanh_cnn": ((1, 28, 28), 256), "resnet9": ((3, 32, 32), 32),
          "mlp": ((1, 8, 8), 64)}


def _engine(config: TrialConfig, shape: tuple[int, ...], captured: bool):  # type: ignore[no-untyped-def]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(config, 10, shape)  # type: ignore[arg-type]
        model = checked_model(model, config) if captured else model.train()
    mode = resolve_clipping(config, basis=60000)
    return make_engine(mode, model, config, torch.Generator().manual_seed(1), noise_multiplier=1.0), mode


def _step(engine, x: torch.Tensor, y: torch.Tensor, n: int) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    engine.backward(x, y, 1, n)
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lines = ["| model | mode | B | Python step (ms) | captured step (ms) | captured / Python (median, IQR) |",
             "|---|---|---|---|---|---|"]
    for name in args.models:
        shape, b = MODELS[name]
        config = TrialConfig(model=name, clipping="auto", batch_size=b, physical_batch_size=max(b, 64), groups=4)
        (plain, mode), (captured, _) = _engine(config, shape, False), _engine(config, shape, True)
        gen = torch.Generator().manual_seed(2)
        rows = padded_size(b)
        x, y = torch.randn((rows, *shape), generator=gen), torch.randint(0, 10, (rows,), generator=gen)
        for _ in range(3):  # warm-up: oneDNN kernels, allocator
            _step(plain, x, y, b)
            _step(captured, x, y, b)
        times: dict[str, list[float]] = {"python": [], "captured": []}
        for r in range(args.reps):  # alternate which goes first
            order = [("python", plain), ("captured", captured)][:: 1 if r % 2 else -1]
            for key, engine in order:
                times[key].append(_step(engine, x, y, b))
        ratios = sorted(c / p for c, p in zip(times["captured"], times["python"], strict=True))
        q = statistics.quantiles(ratios, n=4)
        lines.append(f"| {name} | {mode} | {b} | {1e3 * statistics.median(times['python']):.1f} | "
                     f"{1e3 * statistics.median(times['captured']):.1f} | {statistics.median(ratios):.3f} "
                     f"({q[0]:.3f}–{q[2]:.3f}) |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(f"`python bench/capture_overhead.py --reps {args.reps} --threads {args.threads}`\n\n"
                            f"{text}\n")


if __name__ == "__main__":
    main()
