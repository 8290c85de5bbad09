"""compose.yaml, parsed: the structure the README and docs/deployment.md promise, checked without a Docker engine (the real run is
tests/compose/test_compose_run.py, `./dev test-compose`)."""

from __future__ import annotations

from typing import Any

import yaml

from .conftest import ROOT


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return doc["services"]


def test_redis_keeps_accepted_work_and_needs_the_password_every_role_is_given() -> None:
    services = compose()
    command = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in command and "--maxmemory-policy noeviction" in command
    assert "--maxmemory ${REDIS_MAXMEMORY:-4gb}" in command  # bounded: full refuses new writes, never an OOM kill
    assert "--requirepass ${REDIS_PASSWORD:-" in command
    assert all(p.startswith("127.0.0.1:") for p in services["redis"]["ports"])
    for role in ("api", "worker-cpu", "worker-gpu"):
        assert services[role]["environment"]["REDIS_URL"].startswith("redis://:${REDIS_PASSWORD:-"), role


def test_the_api_sits_behind_one_published_port_and_is_healthy_only_when_ready() -> None:
    services = compose()
    assert "ports" not in services["api"]
    assert "/ready" in " ".join(services["api"]["healthcheck"]["test"])
    assert "/ready" in " ".join(services["proxy"]["healthcheck"]["test"])
    assert services["proxy"]["ports"] == ["${MET_PORT_PUBLISHED:-8000}:8000"]
    assert (ROOT / "deploy" / "nginx.conf").exists()


def test_workers_come_in_a_cpu_and_a_gpu_profile_and_only_the_gpu_one_reserves_devices() -> None:
    services = compose()
    cpu, gpu = services["worker-cpu"], services["worker-gpu"]
    assert (cpu["profiles"], gpu["profiles"]) == (["cpu"], ["gpu"])
    assert cpu["deploy"]["replicas"] == gpu["deploy"]["replicas"] == 2
    assert "resources" not in cpu["deploy"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


def test_prometheus_is_optional_and_scrapes_the_api_with_its_key() -> None:
    prometheus = compose()["prometheus"]
    assert prometheus["profiles"] == ["metrics"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["authorization"]["credentials_file"] == "/tmp/api_key"
    assert "/tmp/api_key" in prometheus["command"][0]
