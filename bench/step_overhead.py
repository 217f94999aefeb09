"""Step-time overhead of DP-SGD over non-private SGD, per clipping mode, measured interleaved.

    python bench/step_overhead.py [--quick] [--reps N] [--models M ...] [--threads N] [--exact-batch] [--no-memory]
        [--out FILE]
    python bench/step_overhead.py --ops MODEL [--reps N] [--threads N] [--out FILE]
    python bench/step_overhead.py --layouts [--reps N] [--threads N] [--out FILE]
    python bench/step_overhead.py --phases MODEL [--reps N] [--threads N] [--out FILE]

The DP step is the one a trial runs (the epoch loop of ``run_trial``): a Poisson logical batch at rate q = B/N,
split into physical batches of at most ``physical_batch_size`` rows as the loop splits them, each padded to the
loop's bucket size (``padded_size``; the padding rows carry zero weight), one engine backward per physical batch,
then the optimizer's step: the Gaussian noise (measured, as a trial measures it) and the SGD update.
``--exact-batch`` times the engine on exactly B rows instead (no Poisson, no padding, no meter: the pure per-example
clipping overhead). The non-private step is plain SGD on a fixed batch of B rows.

For each model the non-private step and the DP step of every mode run round-robin in one process (machine noise hits
all alike), each repetition on the same logical batch for every mode; the table shows median DP time / median
non-private time; for book-keeping also the quartiles of the paired ratios (mostly the Poisson batch sizes' spread)
and a 90 % bootstrap interval of the ratio: this run's noise only (two runs 45 minutes apart: 1.38x, 1.46x). Also the
peak RSS (VmHWM) of a ResNet-9 DP step at physical batch 64, in a fresh subprocess.

``--layouts`` times the GroupNorm CNN and the tanh CNN as built (channels-last on CPU) against the same models in
NCHW, on real data (digits; MNIST t10k when ../shared holds it, else digits upsampled to 28x28): the non-private step
and the book-keeping trial step of each, interleaved in one process.

``--ops MODEL`` profiles instead where the time goes: the non-private step and the book-keeping engine on exactly
B rows, interleaved under torch.profiler, each op's self time per step side by side (the main ops by input shape),
and each step's wall time; wall time less the ops' sum is Python, dispatch and autograd's own work.

``--phases MODEL`` times the same two steps without the profiler (which inflates memory-bound ops), each phase by
wrapping it: book-keeping's forward, its backward to the layer outputs, each layer's norms, the kept per-example
gradients, the recomputed clipped sums, the noise and the step; the non-private forward, backward and step; the rest.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from harness.layouts import MNIST, mnist_t10k, nchw
from harness.memory import peak_rss_gib
from harness.steps import config, exact_step, fake_splits, interleaved, old_padded, plain_step, trial_step
from opacus.utils.uniform_sampler import UniformWithReplacementSampler

from dptune.config import TrialConfig
from dptune.data import Splits
from dptune.dpsgd import Engine, NoiseMeter, init_model, make_engine

MODES = ("hooks", "functorch", "ghost", "bookkeeping")
OLD = "bookkeeping, old buckets"
CASES = (("gn_cnn", (1, 8, 8), 256, 30, 5), ("tanh_cnn", (1, 28, 28), 256, 12, 3),  # tanh_cnn: the MNIST spaces'
         ("resnet9", (3, 32, 32), 32, 8, 2))  # model, input shape, B, default repetitions, --quick repetitions
POOL = 8  # examples in the data = POOL · B, so q = 1 / POOL


def bench_model(model_name: str, shape: tuple[int, int, int], batch: int, reps: int, exact: bool,
                physical: int = 0, old_buckets: bool = False) -> tuple[dict[str, float], tuple[float, ...], list[int], int]:
    cfg = config(model_name, batch)
    chunk = physical or cfg.physical_batch_size
    data = fake_splits(shape, n=batch)
    gen = torch.Generator().manual_seed(0)
    n = POOL * batch
    x = torch.randn(n, *shape, generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    sampler = UniformWithReplacementSampler(num_samples=n, sample_rate=batch / n, steps=reps + 2,
                                            generator=torch.Generator().manual_seed(2))
    logical = [list(b) for b in sampler]
    if exact:
        logical = [list(range(batch))] * (reps + 2)
    xb, yb = x[:batch], y[:batch]
    plain = plain_step(cfg, data, xb, yb)
    steps: dict[str, Callable[[list[int]], None]] = {"non-private": lambda _: plain()}
    for mode in MODES:
        engine = make_engine(mode, init_model(cfg, data), cfg, torch.Generator().manual_seed(1),
                             meter=None if exact else NoiseMeter())

        def dp_step(idx: list[int], engine: Engine = engine) -> None:
            if exact:
                exact_step(engine, xb, yb)
            else:
                trial_step(engine, x, y, idx, chunk)

        steps[mode] = dp_step
    if old_buckets and not exact:  # book-keeping again, its chunks padded to the buckets before 2026-12-07
        old = make_engine("bookkeeping", init_model(cfg, data), cfg, torch.Generator().manual_seed(1), meter=NoiseMeter())
        steps[OLD] = lambda idx: trial_step(old, x, y, idx, chunk, pad=old_padded)
    times = interleaved(steps, logical)
    med = {k: statistics.median(v) for k, v in times.items()}
    if OLD in times:  # per logical batch (the same in both): the median step hides a bucket's gain (bimodal sizes)
        med["paired"] = statistics.mean(a / b for a, b in zip(times["bookkeeping"], times[OLD], strict=True))
    return med, _spread(times["bookkeeping"], times["non-private"]), [len(b) for b in logical[2:]], chunk


def _spread(dp: list[float], plain: list[float], draws: int = 2000) -> tuple[float, ...]:
    """The quartiles of each repetition's dp / plain (the step run just before it), and a 90 % bootstrap interval
    of median(dp) / median(plain), the repetitions resampled as pairs (fixed seed)."""
    paired, gen, n = sorted(d / p for d, p in zip(dp, plain, strict=True)), torch.Generator().manual_seed(0), len(dp)
    ratios = sorted(statistics.median(dp[i] for i in idx) / statistics.median(plain[i] for i in idx)
                    for idx in torch.randint(0, n, (draws, n), generator=gen).tolist())
    return paired[n // 4], paired[(3 * n) // 4], ratios[draws // 20], ratios[draws - 1 - draws // 20]


def _exact_case(model_name: str) -> tuple[TrialConfig, Splits, torch.Tensor, torch.Tensor, Engine]:
    """One model's B rows (synthetic, fixed seed) and a book-keeping engine for them: --ops' and --phases' case."""
    shape, batch = next((s, b) for n, s, b, _, _ in CASES if n == model_name)
    cfg = config(model_name, batch)
    data = fake_splits(shape, n=batch)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, *shape, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
    return cfg, data, x, y, make_engine("bookkeeping", init_model(cfg, data), cfg, torch.Generator().manual_seed(1))


def op_table(model_name: str, reps: int) -> list[str]:
    """Per-op self time (ms per step) of the non-private step and the book-keeping step on the same B rows."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile, record_function

    cfg, data, x, y, engine = _exact_case(model_name)
    steps = {"non-private": plain_step(cfg, data, x, y), "bookkeeping": lambda: exact_step(engine, x, y)}
    for _ in range(2):
        for fn in steps.values():
            fn()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(reps):
            for name, fn in steps.items():
                with record_function(name):
                    fn()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.name in steps)
    wall: dict[str, float] = defaultdict(float)
    for start, end, name in spans:
        wall[name] += (end - start) / reps / 1e3
    ops: dict[str, dict[str, float]] = {name: defaultdict(float) for name in steps}
    shaped = ("aten::convolution_backward", "aten::mkldnn_convolution", "aten::bmm", "aten::copy_",
              "aten::native_group_norm", "aten::mm")
    for e in prof.events():
        if e.name in steps:
            continue
        start = e.time_range.start
        owner = next((n for s0, s1, n in spans if s0 <= start and e.time_range.end <= s1), None)
        if owner is not None:
            key = f"{e.name} {e.input_shapes[:2]}" if e.name in shaped else e.name
            ops[owner][key] += e.self_cpu_time_total / reps / 1e3
    lines = [f"{model_name}, B {len(y)}, {reps} steps of each, interleaved; ms per step (self time)", "",
             "| op | non-private | bookkeeping |", "|---|---|---|"]
    keys = sorted(set(ops["non-private"]) | set(ops["bookkeeping"]),
                  key=lambda k: -(ops["non-private"].get(k, 0.0) + ops["bookkeeping"].get(k, 0.0)))
    for k in keys:
        a, b = ops["non-private"].get(k, 0.0), ops["bookkeeping"].get(k, 0.0)
        if a + b >= 0.1:
            lines.append(f"| `{k}` | {a:.2f} | {b:.2f} |")
    total = {n: sum(v.values()) for n, v in ops.items()}
    lines += [f"| all ops | {total['non-private']:.2f} | {total['bookkeeping']:.2f} |",
              f"| wall time | {wall['non-private']:.2f} | {wall['bookkeeping']:.2f} |",
              f"| wall less ops (Python, dispatch, autograd) | {wall['non-private'] - total['non-private']:.2f} | "
              f"{wall['bookkeeping'] - total['bookkeeping']:.2f} |"]
    return lines


def phase_table(model_name: str, reps: int) -> list[str]:
    """Book-keeping's step on exactly B rows in its phases, each timed by wrapping it (the profiler inflates
    memory-bound ops), interleaved with the non-private step's forward, backward and SGD step; ms per step (mean)."""
    from collections import defaultdict

    cfg, data, x, y, engine = _exact_case(model_name)
    plain = init_model(cfg, data)
    sgd = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    spent: dict[str, float] = defaultdict(float)

    def timed(label: Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            out = fn(*a, **kw)
            spent[label(*a)] += time.perf_counter() - t
            return out
        return run

    grad = torch.autograd.grad
    engine.model.forward = timed(lambda *_: "dp: forward", engine.model.forward)  # type: ignore[method-assign]
    engine._norms = timed(lambda i, m, *_: f"dp: norms, layer {i} ({type(m).__name__})", engine._norms)  # type: ignore
    engine._clipped_sum = timed(lambda *_: "dp: clipped sums recomputed", engine._clipped_sum)  # type: ignore
    engine._keep = timed(lambda *_: "dp: kept gradients (the largest streamed with its sum)", engine._keep)  # type: ignore
    engine.optimizer.step = timed(lambda *_: "dp: noise and the step", engine.optimizer.step)  # type: ignore
    plain.forward = timed(lambda *_: "non-private: forward", plain.forward)  # type: ignore[method-assign]

    def np_step() -> None:
        sgd.zero_grad(set_to_none=True)
        loss = F.cross_entropy(plain(x), y)
        timed(lambda *_: "non-private: backward", loss.backward)()
        float(loss.detach())
        timed(lambda *_: "non-private: SGD step", sgd.step)()

    torch.autograd.grad = timed(lambda *_: "dp: backward to the layer outputs", grad)
    try:
        for rep in range(reps + 2):
            if rep == 2:  # two warm-ups
                spent.clear()
            for total, step in (("non-private: total", np_step), ("dp: total", functools.partial(exact_step,
                                                                                                 engine, x, y))):
                t = time.perf_counter()
                step()
                spent[total] += time.perf_counter() - t
    finally:
        torch.autograd.grad = grad
    lines = [f"{model_name}, B {len(y)}, {reps} steps of each, interleaved; ms per step (mean)", "",
             "| phase | ms |", "|---|---|"]
    for side in ("non-private", "dp"):
        parts = {k: v for k, v in spent.items() if k.startswith(f"{side}: ") and k != f"{side}: total"}
        rest = "the loss, Python, dispatch" if side == "non-private" else "the loss, clip factors, stored sums, Python"
        parts[f"{side}: the rest ({rest})"] = spent[f"{side}: total"] - sum(parts.values())
        lines += [f"| {k} | {v / reps * 1e3:.2f} |" for k, v in parts.items()]
        lines.append(f"| {side}: total | {spent[f'{side}: total'] / reps * 1e3:.2f} |")
    return lines


def _layout_data(model_name: str) -> tuple[Splits, str]:
    from dptune.config import DatasetSpec
    from dptune.data import load_dataset

    digits = load_dataset(DatasetSpec())
    if model_name == "gn_cnn":
        return digits, "digits"
    if MNIST.exists():
        return load_dataset(mnist_t10k()), "MNIST t10k"
    x = F.interpolate(digits.train[0], size=(28, 28), mode="bilinear", align_corners=False)
    return Splits(train=(x, digits.train[1]), val=digits.val, test=digits.test, num_classes=10,
                  input_shape=(1, 28, 28)), "digits at 28x28"


def layout_table(reps: int) -> list[str]:
    """Channels-last (as built) against NCHW: the non-private step and the book-keeping trial step, interleaved."""
    lines = ["| model | data | B | reps | non-private NCHW ms | non-private channels-last ms | speed-up | "
             "DP trial step NCHW ms | DP trial step channels-last ms | speed-up | DP / non-private NCHW | "
             "DP / non-private channels-last |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model_name in ("gn_cnn", "tanh_cnn"):
        data, label = _layout_data(model_name)
        cfg = config(model_name, 256).replace(clipping="bookkeeping")
        x, y = data.train
        sampler = UniformWithReplacementSampler(num_samples=len(y), sample_rate=256 / len(y), steps=reps + 2,
                                                generator=torch.Generator().manual_seed(2))
        logical = [list(b) for b in sampler]
        steps: dict[str, Callable[[list[int]], None]] = {}
        for layout, convert in (("nchw", nchw), ("cl", lambda m: m)):
            plain = plain_step(cfg, data, x[:256], y[:256], convert)
            engine = make_engine("bookkeeping", convert(init_model(cfg, data)), cfg, torch.Generator().manual_seed(1),
                                 meter=NoiseMeter())
            steps[f"{layout} np"] = lambda _, plain=plain: plain()
            steps[f"{layout} dp"] = functools.partial(trial_step, engine, x, y, chunk=cfg.physical_batch_size)
        m = {k: statistics.median(v) * 1e3 for k, v in interleaved(steps, logical).items()}
        lines.append(f"| {model_name} | {label} | 256 | {reps} | {m['nchw np']:.1f} | {m['cl np']:.1f} | "
                     f"{m['nchw np'] / m['cl np']:.2f}x | {m['nchw dp']:.1f} | {m['cl dp']:.1f} | "
                     f"{m['nchw dp'] / m['cl dp']:.2f}x | {m['nchw dp'] / m['nchw np']:.2f}x | "
                     f"{m['cl dp'] / m['cl np']:.2f}x |")
        print(lines[-1], flush=True)
    return lines


def peak_rss_child() -> None:
    cfg = TrialConfig(model="resnet9", batch_size=64, physical_batch_size=64, groups=16, clipping="functorch")
    data = fake_splits((3, 32, 32), n=64)
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    out = {}
    for mode in ("bookkeeping", "hooks"):
        engine = make_engine(mode, init_model(cfg, data), cfg, torch.Generator())
        engine.backward(x, y, 0)
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)
        out[mode] = peak_rss_gib()
    print(" ".join(f"{k}={v:.2f}" for k, v in out.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few repetitions (smoke test)")
    ap.add_argument("--reps", type=int, default=0,
                    help="repetitions per model (0: 30 for gn_cnn, 12 for tanh_cnn, 8 for resnet9)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--exact-batch", action="store_true", help="the engine alone on exactly B rows")
    ap.add_argument("--no-memory", action="store_true", help="skip the ResNet-9 peak-RSS measurement")
    ap.add_argument("--out", type=Path, help="also write the table (markdown) here")
    ap.add_argument("--ops", choices=[c[0] for c in CASES], help="per-op profile of one model (see above)")
    ap.add_argument("--layouts", action="store_true", help="channels-last against NCHW (see above)")
    ap.add_argument("--phases", choices=[c[0] for c in CASES], help="book-keeping's phases, timed (see above)")
    ap.add_argument("--physical", type=int, default=0, help="physical batch size (0: the config's, 256)")
    ap.add_argument("--old-buckets", action="store_true", help="also book-keeping with the chunks padded to the "
                    "buckets before 2026-12-07 (powers of two up to 32), side by side")
    ap.add_argument("--models", nargs="+", choices=[c[0] for c in CASES], help="only these models")
    ap.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        peak_rss_child()
        return
    t0 = time.perf_counter()
    if args.ops or args.layouts or args.phases:
        if args.ops:
            lines = op_table(args.ops, args.reps or 20)
        elif args.phases:
            lines = phase_table(args.phases, args.reps or 30)
        else:
            lines = layout_table(args.reps or 30)
        print("\n".join(lines))
        if args.out:
            args.out.write_text("\n".join(lines) + "\n")
        return
    cases = [(n, s, b, q if args.quick else (args.reps or r)) for n, s, b, r, q in CASES
             if not args.models or n in args.models]
    what = "engine on exactly B rows" if args.exact_batch else "trial step: Poisson batch, physical chunks, padding, noise"
    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} threads; DP step = {what}; "
             "ratio = median DP step / median non-private step (interleaved)", "",
             "| model | B | physical | reps | logical batch sizes | non-private ms | " + " | ".join(MODES)
             + (f" | {OLD}" if args.old_buckets else "")
             + " | bookkeeping, quartiles of paired ratios | bookkeeping, 90 % interval |",
             "|---|---|---|---|---|---|" + "---|" * (len(MODES) + 2 + args.old_buckets)]
    print(lines[0])
    for name, shape, batch, reps in cases:
        med, spread, sizes, chunk = bench_model(name, shape, batch, reps, args.exact_batch, args.physical,
                                                args.old_buckets)
        base = med["non-private"]
        lines.append(f"| {name} | {batch} | {chunk} | {reps} | {min(sizes)}-{max(sizes)} (median "
                     f"{statistics.median(sizes):g}) | {base * 1e3:.1f} | "
                     + " | ".join(f"{med[m] / base:.2f}x" for m in MODES if m in med)
                     + (f" | {med[OLD] / base:.2f}x (new / old, mean of paired steps: {med['paired']:.3f})"
                        if OLD in med else "")
                     + " | {:.2f}-{:.2f}x | {:.2f}-{:.2f}x |".format(*spread))
        print(lines[-1], flush=True)
    if not args.no_memory:
        out = subprocess.run([sys.executable, __file__, "--rss-child"], capture_output=True, text=True, check=True)
        lines += ["", "ResNet-9 DP step, physical batch 64, peak RSS GiB (cumulative over modes): " + out.stdout.strip()]
        print(lines[-1])
    lines += ["", f"wall time {time.perf_counter() - t0:.0f} s"]
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
