"""Plan, search and train on the embedded digits data (scikit-learn's real 8x8 digits, offline).

Shows the whole private workflow through the public API: ``dptune.plan`` prices the search before any
data is read, ``dptune.search`` charges that price to a ledger and releases only the best config (with its
noised score and a certificate), and ``dptune.train`` trains the final model so that search + training
stay within a total ε.

    python examples/digits_plan_search_train.py               # the real thing (ledger: runs/ledger.sqlite)
    python examples/digits_plan_search_train.py --smoke-test  # 1 epoch, a fixed draw, temp dirs: NOT PRIVATE
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import yaml

import dptune

SPACE = Path(__file__).resolve().parent.parent / "search_spaces" / "digits.yaml"
BUDGET_EPSILON = 30.0  # the digits dataset's budget in the ledger (opened by its first search)
SMOKE_SEED = 2  # NOT PRIVATE, smoke test only: a fixed draw (one trial under this space's Poisson(2))


def main(smoke_test: bool, work: Path) -> None:
    space = yaml.safe_load(SPACE.read_text())  # a space is a YAML file or a dict with the same keys
    if smoke_test:
        space["fixed"]["epochs"] = 1
    target = space["privacy"]["target_epsilon"]  # 8 for digits: search + final training, composed
    plan = dptune.plan(space)
    print(f"plan: the search costs epsilon {plan.search_epsilon:.3f} (delta {plan.delta:g}), "
          f"one worst-case trial {plan.trial_epsilon:.3f}")

    found = dptune.search(space, budget_epsilon=BUDGET_EPSILON, ledger=work / "ledger.sqlite", runs_dir=work,
                          num_cpus=2 if smoke_test else None, seed=SMOKE_SEED if smoke_test else None)
    print(f"released config: { {k: found.config[k] for k in space['space']} }")
    print(f"released score: {found.score} (noised validation accuracy: for choosing a config, not a model's)")
    print(f"search epsilon: {found.epsilon:.4f}")

    model = dptune.train(found, target_epsilon=target, train_on_validation=True, seed=1 if smoke_test else None)
    print(f"test accuracy: {model.metrics['test_accuracy']:.4f}")
    print(f"total epsilon: {model.epsilon:.4f} (target {target:g}); model: {model.model}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke-test", action="store_true", help="tiny and fast, NOT PRIVATE, temp dirs")
    if parser.parse_args().smoke_test:
        with tempfile.TemporaryDirectory(prefix="dptune-example-") as tmp:
            main(True, Path(tmp))
    else:
        main(False, Path("runs"))
