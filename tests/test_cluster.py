"""A real 2-node Ray cluster on this machine (head + a second raylet, 1 CPU each, 127.0.0.1):
the search runs trials on both nodes, and the dashboard — loopback only — lists the search's job with its
data-independent charge, seen through the dashboard's HTTP API and in headless Chromium."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import ROOT, digits_seed_with_k, free_port, isolated_env_for, run_cli

# make test-slow (CI runs it): a real two-node Ray cluster, ~50 s to start before the first test
pytestmark = [pytest.mark.ray, pytest.mark.integration]
RAY = str(Path(sys.executable).parent / "ray")


class Cluster:
    def __init__(self, base: Path) -> None:
        self.env = isolated_env_for(base)
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"

    def start(self) -> None:
        # token authentication on every node, as cluster.yaml runs it (Ray >= 2.52)
        self.env["RAY_AUTH_MODE"] = "token"
        r = subprocess.run([RAY, "get-auth-token", "--generate"], env=self.env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        token = Path(self.env["HOME"]) / ".ray" / "auth_token"
        token.parent.chmod(0o700)  # what cluster.yaml's setup_commands do on every node
        token.chmod(0o600)
        self.token = token.read_text().strip()
        common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats"]
        head = [RAY, "start", "--head", f"--port={self.gcs_port}", "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}", *common]
        worker = [RAY, "start", f"--address={self.address}", *common]
        for cmd in (head, worker):
            r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
            assert r.returncode == 0, r.stdout + r.stderr

    def stop(self) -> None:
        subprocess.run([RAY, "stop", "--force"], env=self.env, capture_output=True, timeout=120)

    def get(self, path: str, token: bool = True) -> object:
        req = urllib.request.Request(f"{self.dashboard}{path}")
        if token:  # token auth: HTTP clients send the bearer token
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def search(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    base = tmp_path_factory.mktemp("search")


    seed = digits_seed_with_k(3, 4)
    r = run_cli(["-m", "dptune.search", "--space", "search_spaces/digits.yaml", "--name", "mn",
                 "--runs-dir", str(base / "runs"), "--ledger", str(base / "l.sqlite"), "--budget-epsilon", "30",
                 "--address", cluster.address, "--smoke-test", "--seed", str(seed)], cluster.env)
    assert r.returncode == 0, r.stdout + r.stderr
    return base, r


def test_trials_ran_on_both_nodes(cluster: Cluster, search: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    base, _ = search
    trials = pq.read_table(base / "runs" / "mn" / "sealed" / "trials.parquet").to_pylist()
    assert len({t["node"] for t in trials}) == 2, [t["node"] for t in trials]
    assert all(t["steps"] > 0 and not t["crashed"] for t in trials), [t["error"] for t in trials]


# "your model, your data": a factory model from a module this test writes, importable by the driver alone
USER_NET = '''
from torch import nn


def net(num_classes, input_shape, groups, width=8):
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(c, width, 3, padding=1), nn.GroupNorm(groups, width), nn.Tanh(),
                         nn.Flatten(), nn.Linear(width * h * w, num_classes))
'''


@pytest.mark.slow  # CI runs it (make test-slow): the default suite stays well under 15 min
@pytest.mark.parametrize("layout", ["package", "file"])
def test_a_factory_model_only_the_driver_can_import_runs_on_both_nodes(cluster: Cluster, tmp_path: Path,
                                                                       layout: str) -> None:
    """The module is on the driver's PYTHONPATH only (the raylets' workers were started without it): a
    package ships with Ray's runtime_env py_modules, a single-file module in a working_dir of its own."""
    code = tmp_path / "code"
    module = f"mymodels_{layout}"
    target = code / module / "__init__.py" if layout == "package" else code / f"{module}.py"
    target.parent.mkdir(parents=True)
    target.write_text(USER_NET)
    raw = yaml.safe_load((ROOT / "search_spaces" / "digits.yaml").read_text())
    raw["model"] = {"factory": f"{module}:net", "kwargs": {"width": 8}}
    space = tmp_path / "mine.yaml"
    space.write_text(yaml.safe_dump(raw))
    r = run_cli(["-m", "dptune.search", "--space", str(space), "--name", "mine", "--runs-dir", str(tmp_path / "runs"),
                 "--ledger", str(tmp_path / "l.sqlite"), "--budget-epsilon", "30", "--address", cluster.address,
                 "--smoke-test", "--seed", str(digits_seed_with_k(2, 2))], {**cluster.env, "PYTHONPATH": str(code)})
    assert r.returncode == 0, r.stdout + r.stderr
    run = tmp_path / "runs" / "mine"
    trials = pq.read_table(run / "sealed" / "trials.parquet").to_pylist()
    assert len(trials) == 2 and all(t["steps"] > 0 and not t["crashed"] for t in trials), [t["error"] for t in trials]
    assert len({t["node"] for t in trials}) == 2, [t["node"] for t in trials]
    released = yaml.safe_load((run / "release" / "best_config.yaml").read_text())["config"]
    assert released["model"] == f"factory:{module}:net" and released["model_kwargs"] == {"width": 8}


def test_dashboard_lists_the_job_with_its_charge(cluster: Cluster,
                                                 search: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    base, r = search
    jobs = cluster.get("/api/jobs/")
    assert isinstance(jobs, list)
    mine = [j for j in jobs if j.get("metadata", {}).get("dptune_run") == "mn"]
    assert mine, jobs
    meta = mine[0]["metadata"]
    cert = json.loads((base / "runs" / "mn" / "release" / "certificate.json").read_text())
    assert float(meta["dptune_epsilon"]) == pytest.approx(cert["epsilon"], abs=1e-4)
    assert meta["dptune_delta"] == "1e-05" and meta["dptune_stopping"] == "poisson(mean=2)"
    assert "k" not in {key.lower() for key in meta}
    # the dashboard's job list shows metadata["job_name"] as the Name: which search and its charge
    assert meta["job_name"] == f"dptune search mn: epsilon {cert['epsilon']:.2f}"
    assert mine[0]["status"] == "SUCCEEDED"
    assert cluster.dashboard in r.stdout


def test_dashboard_refuses_requests_without_the_token(cluster: Cluster) -> None:
    import urllib.error

    with pytest.raises(urllib.error.HTTPError) as e:
        cluster.get("/api/jobs/", token=False)
    assert e.value.code in (401, 403)


def _other_local_address() -> str:
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split()
        v4 = [a for a in out if "." in a and not a.startswith("127.")]
        if v4:
            return v4[0]
    except OSError:
        pass
    return "127.0.0.2"  # another loopback address: still not the one the dashboard is bound to


def test_dashboard_listens_on_loopback_only(cluster: Cluster) -> None:
    other = _other_local_address()
    with socket.socket() as s:
        s.settimeout(3)
        assert s.connect_ex((other, cluster.dashboard_port)) != 0, f"dashboard reachable on {other}"
    with socket.socket() as s:
        s.settimeout(3)
        assert s.connect_ex(("127.0.0.1", cluster.dashboard_port)) == 0


def _cdp_screenshot(url: str, cookie: tuple[str, str], out: Path, profile: Path, wait_s: float = 8.0) -> str:
    """Drive headless Chromium over the DevTools protocol (aiohttp, shipped with ray[default]): set the
    dashboard's auth cookie as a signed-in user would have it, load the page, return its text, screenshot."""
    import asyncio
    import base64

    import aiohttp

    port = free_port()
    proc = subprocess.Popen(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                             "--no-first-run", "--disable-background-networking", "--disable-component-update",
                             "--disable-sync", f"--user-data-dir={profile}", "--window-size=1280,900",
                             f"--remote-debugging-port={port}", "--remote-debugging-address=127.0.0.1",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def drive() -> str:
        async with aiohttp.ClientSession() as http:
            for _ in range(100):
                try:
                    async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                        pages = [t for t in await r.json() if t["type"] == "page"]
                    if pages:
                        break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
            async with http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                counter = iter(range(1, 10_000))

                async def call(method: str, **params: object) -> dict:
                    i = next(counter)
                    await ws.send_json({"id": i, "method": method, "params": params})
                    while True:
                        msg = await ws.receive_json()
                        if msg.get("id") == i:
                            return msg.get("result", {})

                await call("Network.enable")
                await call("Network.setCookie", name=cookie[0], value=cookie[1], url=url)
                await call("Page.enable")
                await call("Page.navigate", url=url)
                await asyncio.sleep(wait_s)
                text = await call("Runtime.evaluate", expression="document.body.innerText")
                shot = await call("Page.captureScreenshot", format="png")
                out.write_bytes(base64.b64decode(shot["data"]))
                return str(text.get("result", {}).get("value", ""))

    try:
        return asyncio.run(asyncio.wait_for(drive(), timeout=90))
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian chromium not installed (.ci/run installs it)")
def test_dashboard_in_headless_chromium(cluster: Cluster, search: object, tmp_path: Path) -> None:
    from PIL import Image

    shot = tmp_path / "dashboard.png"
    text = _cdp_screenshot(f"{cluster.dashboard}/#/jobs", ("ray-authentication-token", cluster.token), shot,
                           tmp_path / "profile")
    assert "dptune.search" in text and "SUCCEEDED" in text, text[:2000]  # the search's job, listed
    img = Image.open(shot).convert("RGB")
    assert img.size[0] >= 1000 and shot.stat().st_size > 1000
    assert len(img.resize((160, 112)).getcolors(maxcolors=1 << 16) or []) > 20  # rendered, not blank
    artifacts = ROOT / "runs" / "test-artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, artifacts / "dashboard.png")
