"""Deployment files (issue 13, item 7), checked offline: every Kubernetes manifest against the
Kubernetes schemas (kubernetes-validate, strict: unknown fields fail), the compose file parsed,
and every server command in both parsed by the real launcher, so a renamed flag fails here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from builders import launcher

DOCKER = Path(__file__).resolve().parents[2] / "docker"
MANIFESTS = sorted((DOCKER / "k8s").glob("*.yaml"))
KUBERNETES_VERSION = "1.33"


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def all_resources() -> dict[tuple[str, str], dict[str, Any]]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for path in MANIFESTS for doc in documents(path)}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_against_the_kubernetes_schemas(path: Path) -> None:
    for doc in documents(path):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_broken_manifest_fails_validation() -> None:  # the check above can fail
    deployment = all_resources()[("Deployment", "triton-epd-encoder")]
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_set_of_resources_the_issue_asks_for() -> None:
    resources = all_resources()
    encoder_service = resources[("Service", "triton-epd-encoder")]
    assert encoder_service["spec"]["clusterIP"] == "None"  # headless: one A record per ready pod
    assert ("Service", "triton-epd") in resources and ("ConfigMap", "triton-epd-target") in resources
    hpa = resources[("HorizontalPodAutoscaler", "triton-epd-encoder")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "triton-epd-encoder"
    assert "queue" in hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    configmap = resources[("ConfigMap", "triton-epd-target")]["data"]
    assert configmap["REMOTE_ENCODERS"] == f"dns:{encoder_service['metadata']['name']}:8001"
    for name, role in (("triton-epd-encoder", "encoder"), ("triton-epd-pd", "pd")):
        pod = resources[("Deployment", name)]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
        assert {"cpu", "memory"} <= set(container["resources"]["requests"])
        args = expand(container["args"], {**configmap, "POD_NAME": f"{name}-0"})
        parsed = launcher.parse_args(args)
        assert parsed.role == role and parsed.node_id == f"{name}-0"
        assert str(parsed.cache_path) == configmap["CACHE_PATH"]
        assert parsed.remote_encoders == (configmap["REMOTE_ENCODERS"] if role == "pd" else None)


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in container args; an unknown variable fails the test."""

    def value(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is not in the container's environment"
        return env[match.group(1)]

    return [re.sub(r"\$\(([A-Z_]+)\)", value, arg) for arg in args]


def test_compose_file_has_two_encoders_and_one_pd_server_the_launcher_accepts() -> None:
    compose = yaml.safe_load((DOCKER / "compose.cpu.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"encoder-a", "encoder-b", "pd"}
    parsed = {name: launcher.parse_args(service["command"]) for name, service in services.items()}
    assert [parsed[n].role for n in ("encoder-a", "encoder-b", "pd")] == ["encoder", "encoder", "pd"]
    # encoder-a shares the PD node's store (same node, same volume); encoder-b is another node.
    assert parsed["encoder-a"].node_id == parsed["pd"].node_id != parsed["encoder-b"].node_id
    volume_of = {name: service["volumes"][0].split(":")[0] for name, service in services.items()}
    assert volume_of["encoder-a"] == volume_of["pd"] != volume_of["encoder-b"]
    assert set(volume_of.values()) == set(compose["volumes"])
    remote = parsed["pd"].remote_encoders.split(",")
    assert sorted(address.split(":")[0] for address in remote) == ["encoder-a", "encoder-b"]
    assert all(services[name]["build"]["dockerfile"] == "docker/Dockerfile.cpu" for name in services)
    assert (DOCKER / "Dockerfile.cpu").is_file()
    healthcheck = shlex.join(services["pd"]["healthcheck"]["test"])
    assert "/v2/health/ready" in healthcheck
    assert set(services["pd"]["depends_on"]) == {"encoder-a", "encoder-b"}


def test_each_role_has_cores_of_its_own_and_threads_sized_to_them() -> None:
    """Compose: each service's cpuset is the CPU set its launcher command names (--cpus), the
    encoders apart from the PD server. Kubernetes: Guaranteed QoS with whole CPUs, what the
    static CPU manager needs to give a pod exclusive cores."""
    services = yaml.safe_load((DOCKER / "compose.cpu.yaml").read_text())["services"]
    for name, service in services.items():
        assert launcher.parse_args(service["command"]).cpus == [service["cpuset"]], name
    assert services["encoder-a"]["cpuset"] != services["pd"]["cpuset"]
    for name in ("triton-epd-encoder", "triton-epd-pd"):
        (container,) = all_resources()[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        assert requests == limits and str(requests["cpu"]).isdigit(), name
