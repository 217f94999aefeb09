"""The run directory: ``sealed/`` (curator only, 0700) and ``release/`` (what may leave)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RunDir", "write_private"]


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically with mode 0600 from the first byte (never readable by others,
    even briefly; a crash leaves the previous file intact)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")  # mkstemp creates 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def sealed(self) -> Path:
        return self.root / "sealed"

    @property
    def release(self) -> Path:
        return self.root / "release"

    @property
    def draw_file(self) -> Path:
        return self.sealed / "draw.json"

    @property
    def state_file(self) -> Path:
        return self.sealed / "state.json"

    @property
    def ray_dir(self) -> Path:
        return self.sealed / "ray"

    @property
    def trials_file(self) -> Path:
        return self.sealed / "trials.parquet"

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for d in (self.sealed, self.sealed / "logs", self.ray_dir):
            d.mkdir(mode=0o700, exist_ok=True)
            os.chmod(d, 0o700)  # mkdir's mode is masked by the umask
        self.release.mkdir(exist_ok=True)

    def read_state(self) -> dict[str, Any]:
        return json.loads(self.state_file.read_text()) if self.state_file.exists() else {}

    def write_state(self, **changes: Any) -> None:
        write_private(self.state_file, json.dumps({**self.read_state(), **changes}, indent=1))
