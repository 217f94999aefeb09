"""bench/: one tuning-value harness on dptune's public API. Every bench file is checked by parsing it (no private
dptune import, no bench ⇄ bench import cycle, no sys.path preamble, ≤ 400 lines); the harness's ``--quick`` smoke
check runs for real (digits, 1 epoch, one row) and its report and records are read back."""

from __future__ import annotations

import ast
import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dptune.accounting import rehearsal_key
from dptune.config import load_space, parse_space
from tests.test_architecture import import_cycle

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
FILES = sorted(BENCH.rglob("*.py"))


def _module(path: Path, root: Path = BENCH) -> str:
    """A bench file's import name when ``python bench/x.py`` runs (bench/ on sys.path)."""
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path, source: str | None = None, root: Path = BENCH) -> set[str]:
    """Every module ``path`` imports anywhere (module level, TYPE_CHECKING, functions), relative ones resolved;
    ``from a import b`` names both ``a`` and ``a.b``."""
    tree = ast.parse(source if source is not None else path.read_text())
    me = _module(path, root) if path.is_relative_to(root) else path.stem
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([base] if base else [])])
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def private_dptune_imports(path: Path, source: str | None = None) -> list[str]:
    """dptune module paths with a ``_``-prefixed component that ``path`` imports (``dptune.accounting._rdp``,
    ``dptune.dpsgd._guard``, ``from dptune.accounting import _rules``)."""
    return sorted(name for name in _imports(path, source) if name.split(".")[0] == "dptune" and any(
        part.startswith("_") and not part.startswith("__") for part in name.split(".")[1:]))


def bench_graph(files: list[Path], root: Path = BENCH) -> dict[str, set[str]]:
    """bench module -> the bench modules it imports (``from harness import x`` is an arrow to ``harness.x``)."""
    names = {_module(p, root): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        deps = set()
        for i in _imports(path, root=root):
            parts = i.split(".")
            for k in range(len(parts), 0, -1):
                if ".".join(parts[:k]) in names:
                    deps.add(".".join(parts[:k]))
                    break
        graph[name] = deps - {name}
    return graph


def _sys_path_edits(source: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
               and n.value.id == "sys" for n in ast.walk(ast.parse(source)))


# --- the rules, on every bench file ------------------------------------------------------------------


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(BENCH)))
def test_bench_file_uses_the_public_api_and_stays_small(path: Path) -> None:
    source = path.read_text()
    assert not private_dptune_imports(path), f"{path.name} imports private dptune modules"
    assert not re.search(r"dptune(\.\w+)*\._[a-z]", source), f"{path.name} names a private dptune module"
    assert not _sys_path_edits(source), f"{path.name} edits sys.path (run it from the repository root instead)"
    assert len(source.splitlines()) <= 400, f"{path.name}: {len(source.splitlines())} lines"


def test_no_bench_import_cycle() -> None:
    graph = bench_graph(FILES)
    assert {"tuning_value", "harness.context", "harness.searches"} <= set(graph)
    assert graph["tuning_value"] >= {"harness.context", "harness.report", "harness.runner"}
    assert import_cycle(graph) is None, f"bench import cycle: {' -> '.join(import_cycle(graph) or [])}"
    scripts = {_module(p) for p in FILES if "__main__" in p.read_text()}  # runnable benches
    assert not any(graph[m] & scripts for m in graph), "a bench file imports a script (share through a module)"


def test_the_checks_catch_violations(tmp_path: Path) -> None:
    """The rule engine itself, on violating sources: the checks above can fail."""
    f = tmp_path / "x.py"
    for source in ("from dptune.accounting._rdp import rdp_of\n", "import dptune.dpsgd._guard\n",
                   "def f():\n    from dptune.accounting import _rules\n"):
        assert private_dptune_imports(f, source), source
    assert not private_dptune_imports(f, "from dptune.accounting import trial_steps\nimport dptune.__init__\n")
    assert _sys_path_edits("import sys\nsys.path.insert(0, 'x')\n")
    assert import_cycle({"a": {"b"}, "b": {"harness.c"}, "harness.c": {"a"}}) == ["a", "b", "harness.c", "a"]
    assert import_cycle({"a": {"b"}, "b": set()}) is None
    pkg = tmp_path / "harness"
    pkg.mkdir()
    (pkg / "one.py").write_text("from . import two\n")
    (pkg / "two.py").write_text("from harness.one import x\n")
    graph = bench_graph([pkg / "one.py", pkg / "two.py"], root=tmp_path)  # a relative import counts too
    assert graph == {"harness.one": {"harness.two"}, "harness.two": {"harness.one"}}
    assert import_cycle(graph) is not None


def run_bench(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python bench/<args>`` from the repository root (dptune importable), asserted to exit 0."""
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def harness_modes() -> dict[str, object]:
    """The bench's registered modes (``bench/harness/modes.MODES``), imported as ``python bench/x.py`` would."""
    sys.path.insert(0, str(BENCH))
    try:
        from harness.searches import MODES
    finally:
        sys.path.remove(str(BENCH))
    return dict(MODES)


# --- the harness, run for real ----------------------------------------------------------------------


@pytest.mark.integration  # make test-slow (CI runs it): make bench's whole quick run (five trainings), ~40 s
def test_quick_smoke_run_writes_a_real_report(tmp_path: Path) -> None:
    """``python bench/tuning_value.py --quick``: digits, one row (split seed 0, total ε 4, 1 epoch), the baseline
    and issue 7's modes a2, b, c, d, two workers. The report and the records hold real runs: accuracies from the
    trainer, every composed total within ε, the searches' K and charges."""
    out = tmp_path / "quick.md"
    run_bench("bench/tuning_value.py", "--quick", "--out", str(out), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    text = out.read_text()
    assert "Status: complete" in text and "digits, train 1,257 / validation 180 / test 360" in text
    records = {r["task"]: r for r in json.loads(out.with_suffix(".json").read_text())}
    assert set(records) == {"grid0", "a2", "b", "c", "d"}
    for task, r in records.items():
        assert (r["epsilon"], r["seed"]) == (4.0, 0)
        assert 0.05 < r["test"] <= 1.0, (task, r["test"])  # a trained model, above chance on 10 classes
        assert 0 < r["eps_total"] <= 4.0 * (1 + 1e-9), (task, r["eps_total"])
        assert f"{100 * r['test']:.1f}" in text
    for task in ("b", "c", "d"):
        assert records[task]["k"] == len(records[task]["trials"]) and 0 < records[task]["eps_search"] < 4.0
    assert records["c"]["eps_final"] == 0.0 and records["b"]["sigma_final"] > 0
    assert records["d"]["subsample_n"] < 1257  # the subsample search ran on a Poisson subsample
    table = [line for line in text.splitlines() if line.startswith("| 4 | (")]
    assert len(table) == 5  # (a), (a2), (b), (c), (d)


def test_simulated_rehearsal_goes_through_the_real_draw_and_selection(tmp_path: Path) -> None:
    """``bench/rehearsal_sim.py --from-json`` on a hand-made grid for mnist.yaml at total ε 2: every B 1024 config
    validates at 90 % and releases a 100 % model, every B 256 one 50 % and 80 % (so does the default, and the
    baseline is 80 %). Score noise 0.02 cannot flip 0.9 against 0.5, so B 1024 is released exactly when the
    draw has one: P = 1 − E[0.5^K] = 1 − e^(−3/2) for K ~ Poisson(3), and the gain is 0.2 × P. The grid is of
    a wider space (epochs 5 too, where B 256 would win): mnist.yaml's third version fixes epochs 10 (rebuilt here
    from the shipped file) and reads only those."""
    third = harness_modes()["R3"]
    raw = third.edit(yaml.safe_load((ROOT / "search_spaces" / "mnist.yaml").read_text()))  # type: ignore[attr-defined]
    assert "epochs" not in raw["space"] and raw["fixed"]["epochs"] == 10
    space = tmp_path / "mnist_v3.yaml"
    space.write_text(yaml.safe_dump(raw))
    rows: list[dict[str, object]] = [{"epsilon": 2.0, "seed": 100, "kind": "baseline", "params": {}, "test": 0.8}]
    for b, g, e, lr in itertools.product([256, 1024], [4, 8], [5, 10], [0.4, 0.8, 1.6, 3.2]):
        params = {"batch_size": b, "groups": g, "epochs": e, "learning_rate": lr}
        big, other = b == 1024, e != 10  # epochs 5: a point the space does not reach, made to decide if read
        rows += [{"epsilon": 2.0, "seed": 100, "kind": "trial", "params": params,
                  "val": 0.99 if other and not big else 0.9 if big else 0.5, "diverged": False},
                 {"epsilon": 2.0, "seed": 100, "kind": "final", "params": params,
                  "test": 0.0 if other else 1.0 if big else 0.8, "diverged": False}]
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps(rows))
    out = tmp_path / "sim.md"
    run_bench("bench/rehearsal_sim.py", "--space", str(space), "--from-json", str(grid), "--draws", "3000",
              "--out", str(out))
    assert not out.with_suffix(".json").exists()  # a re-simulation's records are its --from-json files
    row = next(line for line in out.read_text().splitlines() if line.startswith("| 2 | 100 |")).split("|")
    k, p_big, gain = float(row[4]), float(row[5]), float(row[6]) / 100
    expected = 1 - math.exp(-1.5)
    assert abs(k - 3) < 4 * math.sqrt(3 / 3000), k
    assert abs(p_big - expected) < 4 * math.sqrt(expected * (1 - expected) / 3000), p_big
    assert abs(gain - 0.2 * p_big) < 0.002, (gain, p_big)


def test_a_grid_run_skips_what_was_recorded_and_trains_only_without_draws(tmp_path: Path) -> None:
    """``--have`` (records of a run cut short) leaves only the missing runs: given every record of mnist.yaml's
    grid at ε 2 (2 lrs), nothing trains, and ``--draws 0`` writes the records and simulates nothing."""
    space = load_space(ROOT / "search_spaces" / "mnist.yaml")
    lrs = [0.8, 1.6]  # the ends of its L range
    have = [{"epsilon": 2.0, "seed": 100, "kind": "baseline", "params": {}, "test": 0.8}]
    for b, g, e, lr in itertools.product([256, 1024], [4, 8], [10, 20], lrs):
        params = {"learning_rate": lr, "batch_size": b, "groups": g, "epochs": e}
        have += [{"epsilon": 2.0, "seed": 100, "kind": k, "params": params, "val": 0.5, "test": 0.5,
                  "diverged": False} for k in ("trial", "final")]
    assert set(space.space) == {"learning_rate", "batch_size", "groups", "epochs"}
    lines = tmp_path / "have.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in have))
    out = tmp_path / "grid.md"
    res = run_bench("bench/rehearsal_sim.py", "--space", "search_spaces/mnist.yaml", "--seeds", "100", "--epsilons",
                    "2", "--lrs", "2", "--draws", "0", "--have", str(lines), "--out", str(out))
    assert "0 proxy runs (33 records given)" in res.stdout
    assert json.loads(out.with_suffix(".json").read_text()) == have and not out.exists()


def test_the_earlier_versions_rebuilt_from_the_shipped_files_keep_their_verdicts() -> None:
    """The bench rebuilds mnist.yaml's and mnist_tpe.yaml's second to fourth versions (modes R2-R4, T2-T4) from
    the shipped fifth (R5, T5): each rebuilt space is the search its committed verdict rehearsed (its
    ``rehearsal_key`` is the verdict's ``rehearsal_of``; a mismatch would judge it analytically, silently), and the
    versions differ (one searches epochs 5 or 10, one fixes 10, two search 10 or 20, one of them its lr scaled
    with batch size); the fourth keeps its standard errors, the second and third are judged by their sign."""
    modes = harness_modes()
    epochs, scaled = {}, {}
    for mode, file in itertools.product(("2", "3", "4", "5"), ("mnist", "mnist_tpe")):
        name = ("R" if file == "mnist" else "T") + mode
        raw = yaml.safe_load((ROOT / "search_spaces" / f"{file}.yaml").read_text())
        space = parse_space(modes[name].edit(raw))  # type: ignore[attr-defined]
        assert rehearsal_key(space) == space.planner.rehearsal_of, name
        epochs[name] = sorted(space.space["epochs"].choices) if "epochs" in space.space else space.fixed.epochs
        scaled[name] = (space.lr_reference_batch, space.planner.rehearsal_se is not None)
    assert epochs == {"R2": [5, 10], "T2": [5, 10], "R3": 10, "T3": 10, "R4": [10, 20], "T4": [10, 20],
                      "R5": [10, 20], "T5": [10, 20]}
    assert scaled == {**{f"{s}{v}": (None, False) for s in "RT" for v in "23"}, "R4": (None, True),
                      "T4": (None, True), "R5": (256, True), "T5": (256, True)}


@pytest.mark.integration  # make test-slow (CI runs it): two plans of the digits space, ~3 s
def test_the_plan_time_bench_times_this_checkout_against_a_revision(tmp_path: Path) -> None:
    """``bench/plan_time.py --before HEAD``: the plan run from this checkout and from a worktree of HEAD, timed
    side by side, their outputs compared (the same code here: the same output), the worktree removed after."""
    def worktrees() -> list[str]:
        return subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout.splitlines()

    out = tmp_path / "plan_time.json"
    ours = worktrees()
    res = run_bench("bench/plan_time.py", "--spaces", "digits", "--repeats", "1", "--before", "HEAD", "--out", str(out))
    row = json.loads(out.read_text())["spaces"][0]
    assert row["space"] == "digits" and row["same_output"] is True, res.stdout
    assert len(row["after_s"]) == len(row["before_s"]) == 1 and 0 < row["after_s"][0] < 60 and row["ratio"] > 0
    assert "after/before" in res.stdout and "slowest: digits" in res.stdout
    assert worktrees() == ours


@pytest.mark.integration  # make test-slow (CI runs it): four 1-epoch digits trials in fresh processes, ~25 s
def test_the_trial_walltime_bench_runs_whole_trials_of_both_revisions(tmp_path: Path) -> None:
    """``bench/trial_walltime.py --before HEAD --quick``: one whole trial per process from this checkout and from a
    worktree of HEAD, timed with its page faults counted; the same code here trains the same model (same accuracy)."""
    out = tmp_path / "trial_walltime.json"
    res = run_bench("bench/trial_walltime.py", "--cases", "digits", "--repeats", "1", "--quick", "--before", "HEAD",
                    "--out", str(out))
    row = json.loads(out.read_text())["cases"][0]
    assert row["case"] == "digits" and row["same_accuracy"] is True, res.stdout
    for run in row["after"] + row["before"]:
        assert 0 < run["seconds"] < 120 and run["faults"] >= 0 and 0 <= run["val_accuracy"] <= 1
    assert "before/after" in res.stdout


def _md_rows(path: Path) -> list[list[str]]:
    """The body rows of the markdown tables in ``path`` (not their header or rule rows), each cell stripped of
    spaces and backticks."""
    lines = path.read_text().splitlines()
    return [[c.strip(" `") for c in line.strip("|").split("|")] for line, after in zip(lines, [*lines[1:], ""])
            if line.startswith("| ") and not after.startswith("|---")]


def test_the_step_overhead_profile_puts_the_per_example_work_on_the_dp_step_only(tmp_path: Path) -> None:
    """``bench/step_overhead.py --ops gn_cnn``: the non-private and book-keeping steps profiled interleaved; the
    per-example ``bmm`` of the second conv (64 x 288 per example, streamed in blocks of rows) and the clip-factor GEMV
    are the DP step's alone, both steps run the same forward convolution, and each step's ops fit inside its wall
    time."""
    out = tmp_path / "ops.md"
    run_bench("bench/step_overhead.py", "--ops", "gn_cnn", "--reps", "2", "--threads", "1", "--out", str(out))
    rows = {r[0]: [float(v) for v in r[1:]] for r in _md_rows(out)}
    for pattern in (r"aten::bmm \[\[(\d+), 64, 64\], \[\1, 64, 288\]\]", r"aten::mm \[\[1, (\d+)\], \[\1, 18432\]\]"):
        found = [v for k, v in rows.items() if re.fullmatch(pattern, k)]
        assert found and all(v[0] == 0 for v in found) and max(v[1] for v in found) > 0, pattern
    assert min(rows["aten::mkldnn_convolution [[256, 32, 8, 8], [64, 32, 3, 3]]"]) > 0
    for ops, wall in zip(rows["all ops"], rows["wall time"], strict=True):
        assert 0 < ops <= wall


def test_the_every_mode_table_runs_the_chosen_model_with_its_spread(tmp_path: Path) -> None:
    """``bench/step_overhead.py --quick --models gn_cnn``: one row, the GroupNorm CNN's, each mode's ratio, and for
    book-keeping the quartiles of the paired ratios and a bootstrap interval of the ratio, each low to high."""
    out = tmp_path / "modes.md"
    run_bench("bench/step_overhead.py", "--quick", "--models", "gn_cnn", "--threads", "1", "--no-memory",
              "--out", str(out))
    rows = _md_rows(out)
    assert [r[0] for r in rows] == ["gn_cnn"]
    ratios = [float(v.rstrip("x")) for v in rows[0][6:10]]
    (q1, q3), (lo, hi) = ([float(v) for v in rows[0][i].rstrip("x").split("-")] for i in (10, 11))
    assert min(ratios) > 0 and q1 <= q3 and 0 < lo <= hi


def test_a_benchs_peak_memory_is_its_own_not_its_parents() -> None:
    """``harness.memory.peak_rss_gib`` in a child started by a parent holding 768 MiB reads the child's own peak:
    ``ru_maxrss`` read the parent's there (Linux carries it across exec), which put 2.77 GiB in step_overhead's
    ResNet-9 row for a 1.46 GiB step."""
    sys.path.insert(0, str(BENCH))
    try:
        from harness.memory import peak_rss_gib
    finally:
        sys.path.remove(str(BENCH))
    held = bytearray(b"\x01") * (768 << 20)  # written, so resident
    child = subprocess.run([sys.executable, "-c", "from harness.memory import peak_rss_gib; print(peak_rss_gib())"],
                           cwd=ROOT, env={**os.environ, "PYTHONPATH": str(BENCH)}, capture_output=True, text=True,
                           check=True)
    assert peak_rss_gib() >= 0.75 > 0.25 > float(child.stdout)
    del held


def test_the_phase_table_splits_each_step_into_its_timed_parts(tmp_path: Path) -> None:
    """``bench/step_overhead.py --phases gn_cnn``: the book-keeping step's forward, backward, each of the model's
    seven trained layers' norms (in order), the recomputed sums (conv3 by ghost norm, the last Linear) and the step,
    and the rest; the non-private step's parts; each side's parts add up to its total."""
    out = tmp_path / "phases.md"
    run_bench("bench/step_overhead.py", "--phases", "gn_cnn", "--reps", "2", "--threads", "1", "--out", str(out))
    rows = {r[0]: float(r[1]) for r in _md_rows(out)}
    layers = [k.split("(")[1].rstrip(")") for k in rows if k.startswith("dp: norms, layer")]
    assert layers == ["Conv2d", "GroupNorm", "Conv2d", "GroupNorm", "Conv2d", "GroupNorm", "Linear"]
    assert rows["dp: clipped sums recomputed"] > 0 and rows["non-private: backward"] > 0
    for side in ("non-private", "dp"):
        parts = [v for k, v in rows.items() if k.startswith(f"{side}: ") and k != f"{side}: total"]
        assert min(parts) >= -0.01 and sum(parts) == pytest.approx(rows[f"{side}: total"], abs=0.01 * len(parts))


def test_the_layout_table_times_both_cnns_as_built_and_in_nchw(tmp_path: Path) -> None:
    """``bench/step_overhead.py --layouts``: the GroupNorm CNN and the tanh CNN, each as built (channels-last) and
    in NCHW, the non-private step and the book-keeping trial step on real data, one row per model."""
    out = tmp_path / "layouts.md"
    run_bench("bench/step_overhead.py", "--layouts", "--reps", "2", "--threads", "1", "--out", str(out))
    rows = _md_rows(out)
    assert [r[0] for r in rows] == ["gn_cnn", "tanh_cnn"] and rows[0][1] == "digits"
    for r in rows:
        ms = [float(r[i]) for i in (4, 5, 7, 8)]
        assert all(v > 0 for v in ms)
        assert float(r[6].rstrip("x")) == pytest.approx(ms[0] / ms[1], abs=0.01)


def test_layout_accuracy_trains_the_same_init_both_ways(tmp_path: Path) -> None:
    """``bench/layout_accuracy.py``: one digits trial per layout from one seed; the NCHW model is a ``model.factory``
    of the built-in (the same init), so after one epoch the two test accuracies are close, not equal by construction."""
    out = tmp_path / "layouts.md"
    res = run_bench("bench/layout_accuracy.py", "--cases", "digits", "--seeds", "0", "--epochs", "1", "--out", str(out))
    cells = next(r for r in _md_rows(out) if r[0] == "digits")
    nchw, cl = float(cells[3]), float(cells[4])
    assert 0.3 < nchw <= 1 and abs(nchw - cl) <= 0.05, res.stdout


def test_another_revision_runs_only_from_inside_its_tree() -> None:
    """``harness.revisions.dptune_imported``: a ``python -m`` run imports the dptune of its working directory, whatever
    PYTHONPATH says. ``bench/search_walltime.py --before`` ran its searches from this checkout until 2026-11-28, so
    its "before" column timed this checkout's dptune (the same sealed scores as "after"); it runs inside the tree now."""
    from bench.harness.revisions import checkout, dptune_imported

    with checkout("HEAD") as tree:
        assert tree is not None
        env = {**os.environ, "PYTHONPATH": str(tree)}
        assert dptune_imported(tree, env) == (tree / "dptune").resolve()
        assert dptune_imported(ROOT, env) == (ROOT / "dptune").resolve()
