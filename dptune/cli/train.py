"""``python -m dptune.train``: final DP training of a released config, charged and certified with the search.

release (best_config.yaml + certificate.json, ε recomputed) → the search's sealed record and ledger (the
certificate must be that ledger's authenticated charge for that search) → data (fingerprint must match) →
σ (released, or calibrated so search ⊕ training fits ``--target-epsilon``) → ledger.reserve (durable, before
training) → DP-SGD with a fresh 128-bit secret seed (sealed) → ledger.commit → model.pt, metrics.json,
composed and re-bound certificate.json (shareable: no seed, no ledger row, no timing, no local path).
"""

from __future__ import annotations

import argparse
import sys

from dptune.cli._common import run_cli
from dptune.final import TrainingDiverged, TrainRequest, run_final

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dptune.train", description=__doc__.splitlines()[0])
    p.add_argument("--release", required=True, help="a search's release dir, e.g. runs/<name>/release")
    p.add_argument("--out", required=True, help="where to write model.pt, metrics.json, certificate.json")
    p.add_argument("--ledger", help="the privacy ledger (default and only allowed: the one the search recorded)")
    p.add_argument("--run", help="the search's run directory (default: the release's parent, with sealed/)")
    p.add_argument("--target-epsilon", type=float,
                   help="calibrate the noise multiplier so that search + final training cost at most this ε")
    p.add_argument("--train-on-validation", action="store_true", help="train on train ∪ validation")
    p.add_argument("--use-best-checkpoint", action="store_true",
                   help="export the search's best checkpoint instead of training (no new charge)")
    p.add_argument("--epochs", type=float, help="override the released number of epochs")
    p.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, help="NOT PRIVATE: fixed DP noise, for tests/reproducibility only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_cli(lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    try:
        run_final(TrainRequest(**vars(args)))
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
