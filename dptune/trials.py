"""The sealed record of a search's trials: one :class:`TrialRow` schema for the trainable's report, the
runner, ``sealed/trials.parquet`` and the curator report. Curator only — never released."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["TrialRow", "read_trials", "write_trials"]


@dataclass(frozen=True)
class TrialRow:
    """One trial. ``score`` is −∞ for a crashed or diverged trial (it counts: rule 5)."""

    index: int
    params: dict[str, Any]
    seed: str  # ≥ 128-bit secret entropy (decimal): sealed
    score: float
    val_accuracy_raw: float | None = None  # un-noised: sealed
    diverged: bool = False
    crashed: bool = False
    error: str = ""
    steps: int | None = None  # measured by the trainer
    sampling_rate: float | None = None
    noise_multiplier: float | None = None
    measured: dict[str, Any] = field(default_factory=dict)  # what the trainer measured (noise, batches)
    seconds: float | None = None
    started: float | None = None  # wall-clock start (sealed: timings hint at K)
    node: str = ""
    attempts: int = 1
    checkpoint: str | None = None  # a Tune checkpoint dir (not stored in parquet)

    @property
    def rank_key(self) -> tuple[float, int]:
        """Best trial = highest score, ties to the lowest index (−∞ for crashed, diverged or NaN)."""
        s = self.score
        return (s if s is not None and math.isfinite(s) else -math.inf, -self.index)

    @classmethod
    def from_metrics(cls, index: int, seed: int | str, m: dict[str, Any], attempts: int = 1,
                     checkpoint: str | None = None) -> TrialRow:
        """From the trainable's final report (``dptune.tuning.trainable``)."""
        return cls(index=int(index), params=dict(m.get("params") or {}), seed=str(seed),
                   score=float(m.get("score", -math.inf)), val_accuracy_raw=m.get("val_accuracy_raw"),
                   diverged=bool(m.get("diverged", False)), crashed=bool(m.get("crashed", False)),
                   error=str(m.get("error", "")), steps=m.get("steps"), sampling_rate=m.get("sampling_rate"),
                   noise_multiplier=m.get("noise_multiplier"), measured=dict(m.get("measured") or {}),
                   seconds=m.get("seconds"), started=m.get("started"), node=str(m.get("node_id", "")),
                   attempts=max(int(m.get("attempts", 1)), attempts), checkpoint=checkpoint)


_SCHEMA = pa.schema([
    ("index", pa.int64()), ("params", pa.string()), ("seed", pa.string()), ("score", pa.float64()),
    ("val_accuracy_raw", pa.float64()), ("diverged", pa.bool_()), ("crashed", pa.bool_()), ("error", pa.string()),
    ("steps", pa.int64()), ("sampling_rate", pa.float64()), ("noise_multiplier", pa.float64()),
    ("measured", pa.string()), ("seconds", pa.float64()), ("started", pa.float64()), ("node", pa.string()),
    ("attempts", pa.int64()),
])
_JSON = ("params", "measured")


def write_trials(path: Path, rows: list[TrialRow]) -> None:
    """All trials of a search (curator only), mode 0600 from the first byte."""
    table: dict[str, list[Any]] = {name: [] for name in _SCHEMA.names}
    for r in rows:
        d = asdict(r)
        for name in _SCHEMA.names:
            table[name].append(json.dumps(d[name], sort_keys=True) if name in _JSON else d[name])
    tmp = path.with_name(f".{path.name}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    os.chmod(tmp, 0o600)
    pq.write_table(pa.table(table, schema=_SCHEMA), tmp)
    os.replace(tmp, path)


def read_trials(path: Path) -> list[TrialRow]:
    names = {f.name for f in fields(TrialRow)}
    out = []
    for rec in pq.read_table(path).to_pylist():
        for name in _JSON:
            rec[name] = json.loads(rec[name]) if rec.get(name) else {}
        out.append(TrialRow(**{k: v for k, v in rec.items() if k in names}))
    return out
