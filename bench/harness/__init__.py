"""The tuning-value harness behind ``bench/tuning_value.py``: paired-seed evaluation of any searcher against a
baseline on any space, through dptune's public API only.

Modules, each importing only those above it (``tests/test_bench.py`` checks: no cycle, no private dptune import,
no file over 400 lines):

- ``stats``: paired bootstrap CI and t-test, share of the oracle gap.
- ``context``: :class:`~harness.context.Bench`, built from a picklable :class:`~harness.context.BenchSpec`: the
  space file (dataset, split sizes, path, model, fixed settings, δ), the baseline and the oracle grid, one row's
  data, and the final run (σ from ``dptune.accounting.calibrate_final``, as ``dptune train`` calibrates it).
- ``modes``: the :class:`~harness.modes.Mode` interface and its registry (``register``, ``MODES``).
- ``fixed_sigma``: modes a2, b, c, d (issue 7 on digits; b and d on MNIST in issue 13): random search with random
  stopping, σ at the floor the search share affords, plans from the planner's ``advise``.
- ``scaled_rules``: modes s, n (and f) of issue 13: Panda et al.'s linear scaling rule and the noise-scaled rule.
- ``searches``: searches exactly as ``dptune search`` runs them (draw, sampler, selection, planned final run):
  ``search`` (the ``--space`` itself) and the named searches of issues 13 and 21 (R, R2-R5, T, T2-T5, S, A, m, g).
- ``runner``: the worker pool, one task per (ε, seed, mode), the .json records and their pooling.
- ``report``: the markdown report.

Beside them, helpers of the other benches: ``layouts`` (the CNNs in NCHW, MNIST t10k), ``memory`` (peak RSS),
``synthetic`` (CIFAR-shaped folders), ``proxy`` (the public proxies of a rehearsal), ``revisions`` (another git
revision's dptune beside this checkout's).

Importing this package imports none of them (the script and the workers import what they use).
"""
