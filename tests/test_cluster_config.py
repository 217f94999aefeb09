"""cluster.yaml passes the Ray cluster launcher's own preparation and schema validation (as `ray up`)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

CLUSTER = Path(__file__).resolve().parent.parent / "cluster.yaml"


def _validate(config: dict) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_cluster_yaml_is_valid() -> None:
    config = yaml.safe_load(CLUSTER.read_text())
    prepared = _validate(config)
    gpu_types = [t for t, spec in prepared["available_node_types"].items() if spec["resources"].get("GPU", 0) >= 1]
    assert gpu_types, "a GPU worker type"
    setup = " ".join(prepared["setup_commands"])
    assert "pip install" in setup and "dptune" in setup
    head = " ".join(prepared["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "RAY_AUTH_MODE=token" in head
    assert "RAY_AUTH_MODE=token" in " ".join(prepared["worker_start_ray_commands"])
    assert "ray-client-server-port" not in head


def test_cluster_keeps_the_token_private_and_opens_only_ssh() -> None:
    """Issue items 17/18: the copied token is made 0600 in a 0700 dir on every node before Ray starts, and
    the pinned security group lets nothing but SSH in from outside the cluster."""
    prepared = _validate(yaml.safe_load(CLUSTER.read_text()))
    setup = prepared["setup_commands"]
    assert setup[0] == "chmod 700 ~/.ray && chmod 600 ~/.ray/auth_token"
    assert prepared["file_mounts"]["/home/ubuntu/.ray/auth_token"] == "~/.ray/auth_token"
    rules = prepared["provider"]["security_group"]["IpPermissions"]
    assert [(r["IpProtocol"], r["FromPort"], r["ToPort"]) for r in rules] == [("tcp", 22, 22)]


def test_validation_rejects_a_broken_config() -> None:
    import jsonschema

    config = yaml.safe_load(CLUSTER.read_text())
    config["available_node_types"]["gpu_worker"]["unknown_field"] = 1
    with pytest.raises(jsonschema.ValidationError):
        _validate(config)


def test_cluster_turns_ray_usage_stats_off_on_every_node() -> None:
    """Issue 22 item 14: Ray's usage reporting is off on the head and on every worker, and in the nodes' shells
    (jobs and `ray` commands run there)."""
    prepared = _validate(yaml.safe_load(CLUSTER.read_text()))
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        [start] = [c for c in prepared[key] if "ray start" in c]
        assert "RAY_USAGE_STATS_ENABLED=0" in start and "--disable-usage-stats" in start, (key, start)
        assert "RAY_enable_metrics_collection=0" in start, (key, start)  # exporters answer without the token
    assert any("export RAY_USAGE_STATS_ENABLED=0" in c for c in prepared["setup_commands"])
