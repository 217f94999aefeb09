"""dptune in a Jupyter kernel (issue 26 part 5), measured in a fake one: IPython's and ipykernel's modules stubbed
so that Ray, Tune and tqdm take their notebook paths, and IPython's display functions print what they are asked
to do. The header must stay (nothing clears the cell), come before Ray starts, and no warning that tells the
user nothing may appear."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, digits_seed_with_k

FAKE_KERNEL = '''
import sys, types

ipy, disp = types.ModuleType("IPython"), types.ModuleType("IPython.display")


class _Events:
    def register(self, event, callback):
        pass


class ZMQInteractiveShell:  # the class name is what Ray and tqdm check
    config = {"IPKernelApp": {}}
    events = _Events()


class _Handle:
    def update(self, obj):
        print("NOTEBOOK: display updated", flush=True)


def clear_output(wait=False):
    print("NOTEBOOK: clear_output", flush=True)


def display(*objs, **kw):
    print("NOTEBOOK: display", flush=True)
    return _Handle()


class HTML:
    def __init__(self, data=None):
        self.data = data


shell = ZMQInteractiveShell()
ipy.get_ipython = lambda: shell
disp.clear_output, disp.display, disp.HTML = clear_output, display, HTML
ipy.display = disp
sys.modules.update({"IPython": ipy, "IPython.display": disp, "ipykernel": types.ModuleType("ipykernel"),
                    "ipykernel.zmqshell": types.ModuleType("ipykernel.zmqshell")})


class _FirstLine:  # records whether torch was loaded when the first line was written
    def __init__(self, stream):
        self.stream, self.seen = stream, False

    def write(self, text):
        if not self.seen and text.strip():
            self.seen = True
            self.stream.write(f"TORCH LOADED AT FIRST LINE: {'torch' in sys.modules}\\n")
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


sys.stdout = _FirstLine(sys.stdout)
'''


def _kernel(tmp_path: Path, body: str, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "cell.py"
    script.write_text(FAKE_KERNEL + body)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env={**env, "PYTHONPATH": str(ROOT)}, timeout=timeout)


def test_importing_dptune_in_a_notebook_warns_nothing(tmp_path: Path, isolated_env: dict[str, str]) -> None:
    """``import dptune`` warned TqdmWarning "IProgress not found" (optuna imports tqdm.auto), and Ray's import
    logged "Missing packages: ['ipywidgets']" twice: neither concerns a dptune user (dptune shows no progress bar
    and no Ray widget)."""
    r = _kernel(tmp_path, '''
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import dptune
    import dptune.tuning.runner  # what a search imports: Ray, Tune
print("WARNINGS:", [f"{w.category.__name__}: {w.message}" for w in caught])
''', isolated_env)
    assert r.returncode == 0, r.stderr
    assert "WARNINGS: []" in r.stdout, r.stdout
    assert "IProgress" not in r.stderr and "Missing packages" not in r.stderr, r.stderr


@pytest.mark.ray
@pytest.mark.integration  # make test-slow (CI runs it): a Jupyter kernel running a whole search, ~40 s
def test_a_notebook_search_keeps_its_header_and_says_it_before_ray(tmp_path: Path,
                                                                  isolated_env: dict[str, str]) -> None:
    """Tune's JupyterNotebookReporter, built even at verbose=0, cleared the cell as Tune started (erasing the
    header and the dashboard line); the first line came after the data and models were loaded, the dashboard
    line after Ray had started. Measured: nothing clears or displays, the first line precedes torch, and the
    header (run, charge, dashboard URL and how to open it with the token) precedes Ray's start; no warning."""
    seed = digits_seed_with_k(1, 2)
    r = _kernel(tmp_path, f'''
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import dptune
    found = dptune.search({str(ROOT / "search_spaces" / "digits.yaml")!r}, ledger="ledger.sqlite",
                          budget_epsilon=100, name="nb", epochs=2, num_cpus=2, seed={seed})
print("RESULT CONFIG:", sorted(found.config))
print("WARNINGS:", [f"{{w.category.__name__}}: {{w.message}}" for w in caught])
''', {**isolated_env, "RAY_AIR_NEW_OUTPUT": "1"})
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert "NOTEBOOK:" not in out, out  # no clear_output, no display
    lines = out.splitlines()
    assert lines[0] == "TORCH LOADED AT FIRST LINE: False", lines[:2]
    assert lines[1].startswith("dptune search 'nb': space digits"), lines[:2]

    def at(text: str) -> int:
        return next(i for i, line in enumerate(lines) if text in line)

    dashboard = lines[at("Ray dashboard: ")]
    assert "http://127.0.0.1:" in dashboard and "ray get-auth-token" in dashboard, dashboard
    assert at("dptune search 'nb'") < at("charged to the ledger before any trial") < at("Ray dashboard: ") < at(
        "Ray started, dashboard at http://127.0.0.1:") < at("search running")
    assert "Number of trials" not in out and "Missing packages" not in r.stderr + out
    config = lines[at("RESULT CONFIG:")]
    assert "'learning_rate'" in config and "score_noise" not in config and "seed" not in config, config
    # in the notebook's own process (trials run in Ray's workers): none, not even an unclosed sealed log
    assert lines[at("WARNINGS:")] == "WARNINGS: []", lines[at("WARNINGS:")]
