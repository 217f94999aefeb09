"""Wall time of ``dptune plan --space S`` for every shipped space, this checkout against another revision, interleaved.

Each repeat runs the command once with this checkout's dptune, then once with ``--before REV``'s (a git worktree in a
temporary folder, the same Python), so both see the same machine state: on a shared 2-core machine the same command
measures 30-40 % slower in a slow phase, which the ratio cancels and the absolute times do not. Each run is a whole
process (start, imports, the plan with its advice), what a user waits for; its output is compared between the two
revisions (the same certificate values unless the calibration's σ moved within its tolerance).

    python bench/plan_time.py [--spaces digits mnist ...] [--repeats 3] [--before REV] [--out FILE.json]

Prints a table (min and median per revision, and after/before of the medians) and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.revisions import checkout, load_average

ROOT = Path(__file__).resolve().parent.parent


def _plan(tree: Path, space: str) -> tuple[float, str]:
    """(seconds, stdout) of ``python -m dptune.plan --space search_spaces/<space>.yaml`` run in the checkout ``tree``;
    a space the planner refuses without its data (status 2, e.g. a table's size) is reported as (nan, its error)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dptune.plan", "--space", f"search_spaces/{space}.yaml"], cwd=tree,
                       env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    if r.returncode == 2:
        return float("nan"), r.stderr.strip().splitlines()[-1]
    if r.returncode != 0:
        raise SystemExit(f"dptune plan --space {space} failed in {tree}:\n{r.stderr}")
    return seconds, r.stdout


def measure(spaces: list[str], repeats: int, before: Path | None) -> list[dict[str, Any]]:
    rows = []
    for space in spaces:
        after_s: list[float] = []
        before_s: list[float] = []
        outputs: dict[str, str] = {}
        for _ in range(repeats):
            seconds, outputs["after"] = _plan(ROOT, space)
            if seconds != seconds:  # NaN: refused
                print(f"{space:<24} not planned without its data: {outputs['after']}", flush=True)
                break
            after_s.append(seconds)
            if before is not None:
                seconds, outputs["before"] = _plan(before, space)
                before_s.append(seconds)
        if not after_s:
            continue
        row: dict[str, Any] = {"space": space, "after_s": after_s}
        if before is not None:
            row.update(before_s=before_s, same_output=outputs["before"] == outputs["after"],
                       ratio=statistics.median(after_s) / statistics.median(before_s))
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    a = row["after_s"]
    text = f"{row['space']:<24} after min {min(a):.2f} s, median {statistics.median(a):.2f} s"
    if "before_s" in row:
        b = row["before_s"]
        text += (f" | before min {min(b):.2f} s, median {statistics.median(b):.2f} s | after/before "
                 f"{row['ratio']:.2f}x | same output: {row['same_output']}")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spaces", nargs="+", default=sorted(p.stem for p in (ROOT / "search_spaces").glob("*.yaml")),
                    help="space names under search_spaces/ (default: every shipped space)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", metavar="REV", help="also time this git revision's dptune plan, interleaved")
    ap.add_argument("--out", help="write the measurements as JSON here")
    args = ap.parse_args()
    result: dict[str, Any] = {"load_before": load_average(), "before_rev": args.before, "repeats": args.repeats}
    with checkout(args.before) as before:
        result["spaces"] = measure(args.spaces, args.repeats, before)
    result["load_after"] = load_average()
    slowest = max(result["spaces"], key=lambda r: statistics.median(r["after_s"]))
    print(f"slowest: {slowest['space']}, median {statistics.median(slowest['after_s']):.2f} s; load average "
          f"(1, 5, 15 min) {result['load_before']} before, {result['load_after']} after")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
