"""Deployment files (issue 13, item 7; hardened in issue 51), checked offline: every Kubernetes
manifest against the Kubernetes schemas (kubernetes-validate, strict: unknown fields fail), the
compose file parsed, and every server command in both parsed by the real launcher (after the
image's ENTRYPOINT), so a renamed flag fails here. Then the hardening: both images run as a
non-root user; every container runs as it with no capabilities and a read-only root file system,
with each path a start writes on a volume; the keys come from the Secret (or compose's secrets)
as files the servers accept, and its placeholders are ones they refuse; the network policies,
evaluated against the Deployments' pod labels, admit only the callers each role needs. Each
check has a mutated copy that it fails."""

from __future__ import annotations

import base64
import copy
import json
import os
import posixpath
import re
import shlex
import stat
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from builders import access, launcher

DOCKER = Path(__file__).resolve().parents[2] / "docker"
MANIFESTS = sorted((DOCKER / "k8s").glob("*.yaml"))
KUBERNETES_VERSION = "1.33"
IMAGE_UID = 10001  # the user both images create and run as
SERVERS = {"triton-epd-encoder": "encoder", "triton-epd-pd": "pd"}  # Deployment -> role
SECRET = ("Secret", "triton-epd-keys")


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def all_resources() -> dict[tuple[str, str], dict[str, Any]]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for path in MANIFESTS for doc in documents(path)}


def compose_file() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.cpu.yaml").read_text())


def copied(document: Any) -> Any:
    return copy.deepcopy(document)


# --- the images ---------------------------------------------------------------------------------


def dockerfile_steps(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: continuation lines joined, comment lines dropped
    (as Docker drops them, also inside a continuation)."""
    steps, pending = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or (pending and not line.strip()):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = (pending + line).strip(), ""
        if line:
            keyword, _, rest = line.partition(" ")
            steps.append((keyword.upper(), rest.strip()))
    return steps


def entrypoint_args(dockerfile: Path) -> list[str]:
    """The launcher arguments of the image's ENTRYPOINT, which come before a container's own."""
    (entrypoint,) = [
        json.loads(value) for keyword, value in dockerfile_steps(dockerfile.read_text()) if keyword == "ENTRYPOINT"
    ]
    assert entrypoint[0] == "triton-epd-serve"
    return entrypoint[1:]


def image_env(dockerfile: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, value in dockerfile_steps(dockerfile.read_text()):
        if keyword == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(value))
    return env


def image_workdir(dockerfile: Path) -> str:
    return [value for keyword, value in dockerfile_steps(dockerfile.read_text()) if keyword == "WORKDIR"][-1]


def check_image_user(text: str) -> None:
    """The last USER before ENTRYPOINT is the image's non-root user, nothing after it switches back
    or escalates, the steps that write model_repository/ and build/ run as it (so it owns what a
    start rewrites), and it exists with the HOME the image sets."""
    steps = dockerfile_steps(text)
    keywords = [keyword for keyword, _ in steps]
    assert "ENTRYPOINT" in keywords, "no ENTRYPOINT"
    entry = len(keywords) - 1 - keywords[::-1].index("ENTRYPOINT")
    users = [(i, value) for i, (keyword, value) in enumerate(steps[:entry]) if keyword == "USER"]
    assert users, "no USER before ENTRYPOINT: the image runs as root"
    at, user = users[-1]
    uid, _, gid = user.partition(":")
    assert uid not in ("root", "0") and gid not in ("root", "0"), f"USER {user} is root"
    assert uid == str(IMAGE_UID), f"USER {user}: the manifests run uid {IMAGE_UID}"
    for keyword, value in steps[at + 1 :]:
        assert keyword != "USER" or value == user, f"USER {value} after USER {user}"
        assert keyword != "RUN" or not re.search(r"\b(sudo|su|gosu|su-exec|setpriv)\b", value), value
    after = [value for keyword, value in steps[at + 1 :] if keyword == "RUN"]
    assert any("triton-epd-build-repo" in value for value in after), "the repository is built as root"
    copies = [value for keyword, value in steps[:at] if keyword == "COPY" and "model_repository" in value]
    assert copies and all(f"--chown={IMAGE_UID}:" in value for value in copies), copies
    env = dict(item.split("=", 1) for keyword, value in steps if keyword == "ENV" for item in shlex.split(value))
    useradd = [value for keyword, value in steps[:at] if keyword == "RUN" and "useradd" in value]
    assert useradd and f"--uid {IMAGE_UID}" in useradd[0] and f"--home-dir {env.get('HOME')} " in useradd[0]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_each_image_ends_as_its_non_root_user(name: str) -> None:
    check_image_user((DOCKER / name).read_text())
    assert entrypoint_args(DOCKER / name)[-2:] == ["--host", "0.0.0.0"]  # reachable outside the container


@pytest.mark.parametrize(
    "mutate",
    [
        lambda text: text.replace("ENTRYPOINT", "USER root\nENTRYPOINT"),
        lambda text: text.replace("ENTRYPOINT", "USER 0:0\nENTRYPOINT"),
        lambda text: text + "USER root\n",
        lambda text: re.sub(r"^USER .*$", "", text, flags=re.M),
        lambda text: text.replace("EXPOSE", "RUN sudo chmod -R a+w /opt\nEXPOSE"),
        lambda text: text.replace(f"--chown={IMAGE_UID}:{IMAGE_UID} ", ""),
    ],
    ids=["root-before-entrypoint", "uid-0", "root-after-entrypoint", "no-user", "sudo", "repository-root's"],
)
def test_a_root_image_fails_the_user_check(mutate: Callable[[str], str]) -> None:
    with pytest.raises(AssertionError):
        check_image_user(mutate((DOCKER / "Dockerfile.cpu").read_text()))


def test_the_seed_script_is_installed_where_the_init_containers_call_it() -> None:
    commands = {pod_spec(all_resources()[("Deployment", name)])["initContainers"][0]["command"][0] for name in SERVERS}
    for name in ("Dockerfile", "Dockerfile.cpu"):
        steps = dockerfile_steps((DOCKER / name).read_text())
        installed = {value.split()[-1] for keyword, value in steps if keyword == "COPY" and "docker/seed.sh" in value}
        assert {posixpath.basename(path) for path in installed} == commands, name
        assert all(path.startswith("/usr/local/bin/") for path in installed)


# --- what a start writes ------------------------------------------------------------------------


def written_at_start(app: str, home: str, store: str) -> dict[str, str]:
    """Path in the container -> what a server's start writes there (builders/launcher.py main).
    ``app``: the image's WORKDIR, where the repository is installed; ``store``: the embedding
    store's path the servers are given."""
    from builders.artifacts import DEFAULT_STAMPS
    from builders.default_model import DEFAULT_MODEL_DIR
    from builders.repository import DEFAULT_REPOSITORY, TARGETS
    from builders.tritonserver import REPO_ROOT

    def in_image(path: Path) -> str:
        return posixpath.join(app, path.relative_to(REPO_ROOT).as_posix())

    return {
        in_image(DEFAULT_REPOSITORY): "the configs each start writes (write_repository)",
        in_image(DEFAULT_STAMPS): "the artefacts' stamps (and the TensorRT plan on gpu)",
        in_image(DEFAULT_MODEL_DIR): "the default model, built when missing",
        in_image(REPO_ROOT / "build" / "triton_backends"): "the python backend stub (pytriton's tritonserver)",
        "/tmp": "tempfile: stage heartbeats, vLLM's sockets, torch's compiled kernels",
        f"{home}/.cache": "vLLM's, torch's, triton's and Hugging Face's caches",
        f"{home}/.config": "vLLM's settings",
        "/dev/shm": "Triton's python backend shared memory",
        TARGETS["cpu"].pd.kv_store_path: "the prefill -> decode KV folder",
        store: "the embedding store",
    }


def covering(path: str, mounts: dict[str, Any]) -> Any:
    """The mount (of ``mounts``, by mount path) that ``path`` lies on, the deepest; None: none."""
    found = [point for point in mounts if path == point or path.startswith(point.rstrip("/") + "/")]
    return mounts[max(found, key=len)] if found else None


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def server_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_spec(deployment)["containers"]
    return container


def k8s_written_paths() -> dict[str, str]:
    dockerfile = DOCKER / "Dockerfile.cpu"
    configmap = all_resources()[("ConfigMap", "triton-epd-target")]["data"]
    return written_at_start(image_workdir(dockerfile), image_env(dockerfile)["HOME"], configmap["CACHE_PATH"])


def check_pod_hardened(deployment: dict[str, Any], written: dict[str, str]) -> None:
    """Every container (init ones too) runs as the image's user, non-root, with no capabilities,
    no privilege gain, the runtime's seccomp profile and a read-only root file system; the server
    has each path a start writes on a writable emptyDir; no service account token."""
    pod = pod_spec(deployment)
    name = deployment["metadata"]["name"]
    assert pod.get("automountServiceAccountToken") is False, name
    assert not any(pod.get(key) for key in ("hostNetwork", "hostPID", "hostIPC")), name
    pod_context = pod.get("securityContext", {})
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert not any("hostPath" in volume for volume in volumes.values()), name
    for container in pod.get("initContainers", []) + pod["containers"]:
        context = container.get("securityContext", {})

        def effective(key: str, context: dict[str, Any] = context) -> Any:
            return context.get(key, pod_context.get(key))

        where = f"{name}/{container['name']}"
        assert effective("runAsNonRoot") is True, where
        assert effective("runAsUser") == IMAGE_UID, where  # the image's user owns what a start rewrites
        assert effective("runAsGroup") != 0, where
        assert effective("seccompProfile") == {"type": "RuntimeDefault"}, where
        assert context.get("allowPrivilegeEscalation") is False, where
        assert context.get("readOnlyRootFilesystem") is True, where
        assert not context.get("privileged"), where
        capabilities = context.get("capabilities", {})
        assert capabilities.get("drop") == ["ALL"] and not capabilities.get("add"), where
        assert all(mount["name"] in volumes for mount in container.get("volumeMounts", [])), where
    mounts = {mount["mountPath"]: mount for mount in server_container(deployment)["volumeMounts"]}
    for path, what in written.items():
        mount = covering(path, mounts)
        assert mount is not None, f"{name}: {path} ({what}) is on the read-only root file system"
        assert not mount.get("readOnly"), f"{name}: {path} ({what}) is on a read-only mount"
        assert "emptyDir" in volumes[mount["name"]], f"{name}: {path} ({what}) is not on an emptyDir"


@pytest.mark.parametrize("name", SERVERS)
def test_every_container_runs_hardened_with_its_writable_paths_on_volumes(name: str) -> None:
    check_pod_hardened(all_resources()[("Deployment", name)], k8s_written_paths())


def _container(deployment: dict[str, Any], init: bool = False) -> dict[str, Any]:
    return pod_spec(deployment)["initContainers" if init else "containers"][0]


def _unmount(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(deployment: dict[str, Any]) -> None:
        container = _container(deployment)
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["mountPath"] != path]

    return mutate


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: _container(d)["securityContext"].update(readOnlyRootFilesystem=False),
        lambda d: _container(d, init=True)["securityContext"].pop("readOnlyRootFilesystem"),
        lambda d: _container(d)["securityContext"].update(runAsUser=0),
        lambda d: pod_spec(d)["securityContext"].update(runAsNonRoot=False),
        lambda d: _container(d)["securityContext"].update(allowPrivilegeEscalation=True),
        lambda d: _container(d)["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
        lambda d: _container(d, init=True)["securityContext"].update(capabilities={"drop": ["NET_RAW"]}),
        lambda d: pod_spec(d)["securityContext"].pop("seccompProfile"),
        lambda d: pod_spec(d).pop("automountServiceAccountToken"),
        _unmount("/tmp"),
        _unmount("/opt/triton-epd/build"),
        _unmount("/home/triton-epd"),
        lambda d: next(m for m in _container(d)["volumeMounts"] if m["mountPath"] == "/tmp").update(readOnly=True),
    ],
    ids=[
        "rw-root",
        "init-rw-root",
        "root",
        "may-run-as-root",
        "escalation",
        "cap-add",
        "caps-kept",
        "no-seccomp",
        "sa-token",
        "no-tmp",
        "no-build",
        "no-home",
        "tmp-read-only",
    ],
)
def test_a_weakened_pod_fails_the_hardening_check(mutate: Callable[[dict[str, Any]], None]) -> None:
    deployment = copied(all_resources()[("Deployment", "triton-epd-encoder")])
    mutate(deployment)
    with pytest.raises(AssertionError):
        check_pod_hardened(deployment, k8s_written_paths())


@pytest.mark.parametrize("name", SERVERS)
def test_the_seed_init_container_fills_the_volumes_the_server_mounts(name: str) -> None:
    """The init container copies the image's model_repository/ and build/ into the volumes the
    server mounts over them, and the Secret's keys into the volume the server reads them from."""
    deployment = all_resources()[("Deployment", name)]
    pod, server = pod_spec(deployment), server_container(deployment)
    (seed,) = pod["initContainers"]
    seed_dir, secrets_dir, keys_dir = seed["command"][1:]
    seed_at = {mount["mountPath"]: mount for mount in seed["volumeMounts"]}
    server_at = {mount["mountPath"]: mount for mount in server["volumeMounts"]}
    app = image_workdir(DOCKER / "Dockerfile.cpu")
    for folder in ("model_repository", "build"):
        assert seed_at[f"{seed_dir}/{folder}"]["name"] == server_at[f"{app}/{folder}"]["name"], folder
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert "secret" in volumes[seed_at[secrets_dir]["name"]] and seed_at[secrets_dir].get("readOnly")
    keys = [mount for mount in server["volumeMounts"] if mount["name"] == seed_at[keys_dir]["name"]]
    assert len(keys) == 1 and keys[0].get("readOnly"), "the server reads its keys from the seeded volume"
    # The Secret's own volume stays in the init container: its files are group-readable.
    assert all("secret" not in volumes[mount["name"]] for mount in server["volumeMounts"])
    # Guaranteed QoS (exclusive cores) needs requests == limits in every container, init ones too.
    assert seed["resources"]["requests"] == seed["resources"]["limits"]


def test_the_seed_script_copies_the_image_files_and_makes_the_keys_owner_only(tmp_path: Path) -> None:
    app, seed, keys = tmp_path / "app", tmp_path / "seed", tmp_path / "keys"
    artefact = app / "model_repository" / "preprocess" / "1" / "model.dali"
    stamp = app / "build" / "stamps" / "dali-0.json"
    for path in (artefact, stamp):
        path.parent.mkdir(parents=True)
        path.write_text(path.name)
        os.utime(path, ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    for folder in ("model_repository", "build"):
        (seed / folder).mkdir(parents=True)
    keys.mkdir()
    secret = kubelet_secret_volume(tmp_path / "secret", {"peer-key": "p" * 43, "admin-key": "a" * 43})
    for _ in range(2):  # a pod's restart runs it again over the same volumes
        subprocess.run(
            ["sh", str(DOCKER / "seed.sh"), str(seed), str(secret), str(keys)],
            env={**os.environ, "TRITON_EPD_APP": str(app)},
            check=True,
            capture_output=True,
        )
    for path in (artefact, stamp):
        copy_of = seed / path.relative_to(app)
        # The stamps record their artefacts' mtimes: a copy with others would be rebuilt at start.
        assert copy_of.read_text() == path.name and copy_of.stat().st_mtime_ns == path.stat().st_mtime_ns
    assert sorted(p.name for p in keys.iterdir()) == ["admin-key", "peer-key"]
    for path in keys.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o400 and not path.is_symlink()
        assert access.read_key(path) == path.name[0] * 43


def kubelet_secret_volume(root: Path, files: dict[str, str]) -> Path:
    """A Secret volume as kubelet writes it: KEY -> ..data/KEY, ..data -> a timestamped folder;
    0440 (defaultMode with an fsGroup)."""
    data = root / "..2026_01_01_00_00_00.000000000"
    data.mkdir(parents=True)
    for key, value in files.items():
        (data / key).write_text(value + "\n")
        (data / key).chmod(0o440)
    (root / "..data").symlink_to(data.name)
    for key in files:
        (root / key).symlink_to(f"..data/{key}")
    return root


# --- keys ---------------------------------------------------------------------------------------


def read_api_keys(path: Path) -> None:
    from client.openai_server.auth import check_file_mode, parse_keys_file

    check_file_mode(path.stat().st_mode, str(path))
    if not parse_keys_file(path.read_text(), str(path)):
        raise ValueError(f"{path}: no key")


def read_tenant_secret(path: Path) -> None:
    from python_backends.request.tenants import read_tenant_secret

    read_tenant_secret(path)


# The launcher's key-file flags (parse_args' names) -> the check the servers make of such a file.
KEY_FILE_READERS: dict[str, Callable[[Path], Any]] = {
    "admin_key_file": access.read_key,
    "peer_key_file": access.read_key,
    "tenant_secret_file": read_tenant_secret,
    "api_keys_file": read_api_keys,
}


def k8s_server_args(deployment: dict[str, Any]) -> Any:
    configmap = all_resources()[("ConfigMap", "triton-epd-target")]["data"]
    name = deployment["metadata"]["name"]
    args = expand(server_container(deployment)["args"], {**configmap, "POD_NAME": f"{name}-0"})
    return launcher.parse_args([*entrypoint_args(DOCKER / "Dockerfile.cpu"), *args])


def k8s_key_files(deployment: dict[str, Any]) -> dict[str, str]:
    """Launcher flag -> the Secret key its file holds, followed from the server's argument through
    its mount and the seed init container to the Secret volume's items."""
    pod, parsed = pod_spec(deployment), k8s_server_args(deployment)
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    (seed,) = pod["initContainers"]
    seed_at = {mount["mountPath"]: mount["name"] for mount in seed["volumeMounts"]}
    _, secrets_dir, keys_dir = seed["command"][1:]
    secret = volumes[seed_at[secrets_dir]]["secret"]
    items = {item["path"]: item["key"] for item in secret["items"]}
    server_at = {mount["mountPath"]: mount for mount in server_container(deployment)["volumeMounts"]}
    keys: dict[str, str] = {}
    for flag in KEY_FILE_READERS:
        if getattr(parsed, flag) is None:
            continue
        path = PurePosixPath(getattr(parsed, flag))
        mount = server_at[str(path.parent)]
        assert mount.get("readOnly") and mount["name"] == seed_at[keys_dir], f"{flag}: {path} is not a seeded key"
        assert secret["secretName"] == SECRET[1]
        keys[flag] = items[path.name]
    return keys


def secret_values() -> dict[str, str]:
    secret = all_resources()[SECRET]
    data = {key: base64.b64decode(value).decode() for key, value in secret.get("data", {}).items()}
    return {**data, **secret.get("stringData", {})}


def check_secret_keys_exist(resources: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Every Secret a Deployment mounts or reads into its environment is a manifest here, with
    every key it names."""

    def keys_of(secret_name: str) -> set[str]:
        assert ("Secret", secret_name) in resources, f"no Secret {secret_name}"
        secret = resources[("Secret", secret_name)]
        return {*secret.get("data", {}), *secret.get("stringData", {})}

    for (kind, name), resource in resources.items():
        if kind != "Deployment":
            continue
        pod = pod_spec(resource)
        for volume in pod["volumes"]:
            if "secret" in volume:
                wanted = {item["key"] for item in volume["secret"].get("items", [])}
                assert wanted <= keys_of(volume["secret"]["secretName"]), f"{name}: {volume['name']}"
        for container in pod.get("initContainers", []) + pod["containers"]:
            for variable in container.get("env", []):
                ref = variable.get("valueFrom", {}).get("secretKeyRef")
                assert ref is None or ref["key"] in keys_of(ref["name"]), f"{name}: {ref}"
            for source in container.get("envFrom", []):
                assert "secretRef" not in source or keys_of(source["secretRef"]["name"]), name


def test_every_secret_key_a_deployment_uses_exists() -> None:
    check_secret_keys_exist(all_resources())


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: r[SECRET]["stringData"].pop("peer-key"),
        lambda r: pod_spec(r[("Deployment", "triton-epd-pd")])["volumes"][-1]["secret"].update(secretName="keys"),
        lambda r: _container(r[("Deployment", "triton-epd-pd")])["env"].append(
            {"name": "X", "valueFrom": {"secretKeyRef": {"name": SECRET[1], "key": "admin_key"}}}
        ),
    ],
    ids=["key-missing", "secret-missing", "env-key-missing"],
)
def test_a_missing_secret_key_fails_the_secret_check(mutate: Callable[[dict[tuple[str, str], Any]], Any]) -> None:
    resources = copied(all_resources())
    mutate(resources)
    with pytest.raises(AssertionError):
        check_secret_keys_exist(resources)


def test_each_server_reads_the_keys_its_role_needs_from_the_secret() -> None:
    resources = all_resources()
    encoder = k8s_key_files(resources[("Deployment", "triton-epd-encoder")])
    pd = k8s_key_files(resources[("Deployment", "triton-epd-pd")])
    assert set(encoder) == {"admin_key_file", "peer_key_file", "tenant_secret_file"}
    assert set(pd) == set(KEY_FILE_READERS)
    # The key the encoders require is the one the PD servers send; one tenant secret for all.
    assert encoder["peer_key_file"] == pd["peer_key_file"]
    assert encoder["tenant_secret_file"] == pd["tenant_secret_file"]
    assert set(encoder.values()) | set(pd.values()) == set(secret_values())
    parsed = k8s_server_args(resources[("Deployment", "triton-epd-pd")])
    assert (parsed.openai_port, parsed.openai_host) == (9000, "0.0.0.0")
    ports = {
        port["name"]: port["containerPort"]
        for port in server_container(resources[("Deployment", "triton-epd-pd")])["ports"]
    }
    assert ports["openai"] == parsed.openai_port
    assert "openai" in {port["targetPort"] for port in resources[("Service", "triton-epd")]["spec"]["ports"]}


def test_the_secret_manifest_placeholders_are_refused_by_the_servers(tmp_path: Path) -> None:
    """Applied as it is, secrets.yaml must not run a deployment on keys anyone can read here."""
    values = secret_values()
    flags = {
        key: flag for name in SERVERS for flag, key in k8s_key_files(all_resources()[("Deployment", name)]).items()
    }
    assert set(flags) == set(values)
    for key, value in values.items():
        path = tmp_path / key
        path.write_text(value)
        path.chmod(0o600)
        with pytest.raises(ValueError):
            KEY_FILE_READERS[flags[key]](path)


def generated_keys(tmp_path: Path) -> Path:
    out = tmp_path / "keys"
    subprocess.run(["sh", str(DOCKER / "secrets" / "generate.sh"), str(out)], check=True, capture_output=True)
    return out


def test_the_generated_keys_are_accepted_by_the_servers_and_kept(tmp_path: Path) -> None:
    out = generated_keys(tmp_path)
    flags = {
        key: flag for name in SERVERS for flag, key in k8s_key_files(all_resources()[("Deployment", name)]).items()
    }
    assert {path.name for path in out.iterdir()} == set(flags) == set(secret_values())
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    for path in out.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
        KEY_FILE_READERS[flags[path.name]](path)
    assert {path.name: path.read_bytes() for path in generated_keys(tmp_path).iterdir()} == before
    assert access.read_key(out / "peer-key") != access.read_key(out / "admin-key")


# --- network policies ---------------------------------------------------------------------------

APP_NAMESPACE = "triton-epd"


@dataclass(frozen=True)
class Pod:
    labels: dict[str, str]
    namespace: str = APP_NAMESPACE
    namespace_labels: dict[str, str] = field(default_factory=dict)

    def ns_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace, **self.namespace_labels}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions; {} selects everything)."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, values = expression["key"], expression.get("values", [])
        present = key in labels
        if not {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels[key] not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[expression["operator"]]:
            return False
    return True


def peer_matches(peer: dict[str, Any], policy_namespace: str, pod: Pod) -> bool:
    """A NetworkPolicy peer: podSelector alone means the policy's namespace; namespaceSelector and
    podSelector in one peer must both match."""
    assert "ipBlock" not in peer, "ipBlock peers are not evaluated here"
    in_namespace = (
        pod.namespace == policy_namespace
        if "namespaceSelector" not in peer
        else selects(peer["namespaceSelector"], pod.ns_labels())
    )
    return in_namespace and ("podSelector" not in peer or selects(peer["podSelector"], pod.labels))


def port_matches(ports: list[dict[str, Any]] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for rule in ports:
        assert rule.get("port") is None or isinstance(rule["port"], int), "named ports are not evaluated here"
        low = rule.get("port")
        high = rule.get("endPort", low)
        if rule.get("protocol", "TCP") == protocol and (low is None or low <= port <= high):
            return True
    return False


def policy_types(spec: dict[str, Any]) -> list[str]:
    """policyTypes, or its default: Ingress, and Egress when the policy has egress rules."""
    return spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]


def allows(
    policies: list[dict[str, Any]], source: Pod, target: Pod, port: int, protocol: str = "TCP", check: str = "both"
) -> bool:
    """Whether the policies (all in APP_NAMESPACE) let ``source`` open ``port`` on ``target``: the
    target's ingress and the source's egress must both allow it (``check``: "ingress" or "egress"
    for one side alone). A pod no policy selects for a direction is not isolated in it; an
    isolated pod allows what any selecting policy's rule does."""

    def side(pod: Pod, direction: str, rules_key: str, peers_key: str, other: Pod) -> bool:
        selecting = [
            policy["spec"]
            for policy in policies
            if pod.namespace == APP_NAMESPACE
            and selects(policy["spec"]["podSelector"], pod.labels)
            and direction in policy_types(policy["spec"])
        ]
        if not selecting:
            return True
        return any(
            (not rule.get(peers_key) or any(peer_matches(peer, APP_NAMESPACE, other) for peer in rule[peers_key]))
            and port_matches(rule.get("ports"), port, protocol)
            for spec in selecting
            for rule in spec.get(rules_key, [])
        )

    ingress = check == "egress" or side(target, "Ingress", "ingress", "from", source)
    return ingress and (check == "ingress" or side(source, "Egress", "egress", "to", target))


def network_policies(resources: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    return [resource for (kind, _), resource in resources.items() if kind == "NetworkPolicy"]


def check_network_policies(resources: dict[tuple[str, str], dict[str, Any]]) -> None:
    """Evaluates the policies against the Deployments' pod labels and the callers around them."""
    policies = network_policies(resources)
    labels = {role: pod_spec_labels(resources[("Deployment", name)]) for name, role in SERVERS.items()}
    encoder, pd = Pod(labels["encoder"]), Pod(labels["pd"])
    gateway = Pod({"app.kubernetes.io/component": "gateway"})
    other = Pod({"app.kubernetes.io/name": "something-else"})
    pd_elsewhere = Pod(labels["pd"], namespace="other")
    prometheus = Pod({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")
    prometheus_elsewhere = Pod({"app.kubernetes.io/name": "prometheus"}, namespace="other")
    grafana = Pod({"app.kubernetes.io/name": "grafana"}, namespace="monitoring")
    dns = Pod({"k8s-app": "kube-dns"}, namespace="kube-system")
    internet = Pod({}, namespace="outside")  # anything else
    # Each side on its own (a loosened ingress is a hole even while the caller's egress is shut),
    # then the flows the deployment needs end to end.
    expected = [
        ("ingress", pd, encoder, 8001, "TCP", True),
        ("ingress", pd, encoder, 8000, "TCP", False),
        ("ingress", gateway, encoder, 8001, "TCP", False),
        ("ingress", other, encoder, 8001, "TCP", False),
        ("ingress", encoder, encoder, 8001, "TCP", False),
        ("ingress", pd_elsewhere, encoder, 8001, "TCP", False),
        ("ingress", prometheus, encoder, 8002, "TCP", True),
        ("ingress", prometheus, encoder, 8001, "TCP", False),
        ("ingress", prometheus_elsewhere, encoder, 8002, "TCP", False),
        ("ingress", grafana, encoder, 8002, "TCP", False),
        *[("ingress", gateway, pd, port, "TCP", True) for port in (8000, 8001, 9000)],
        ("ingress", gateway, pd, 8002, "TCP", False),
        ("ingress", other, pd, 8000, "TCP", False),
        ("ingress", encoder, pd, 8001, "TCP", False),
        ("ingress", pd, pd, 8001, "TCP", False),
        ("ingress", internet, pd, 9000, "TCP", False),
        ("ingress", prometheus, pd, 8002, "TCP", True),
        ("ingress", grafana, pd, 8002, "TCP", False),
        ("egress", pd, encoder, 8001, "TCP", True),
        ("egress", pd, encoder, 8000, "TCP", False),
        ("egress", pd, dns, 53, "UDP", True),
        ("egress", pd, dns, 53, "TCP", True),
        ("egress", encoder, dns, 53, "UDP", True),
        ("egress", encoder, encoder, 8001, "TCP", False),
        ("egress", encoder, pd, 8001, "TCP", False),
        ("egress", encoder, internet, 443, "TCP", False),
        ("egress", pd, internet, 443, "TCP", False),
        ("egress", pd, gateway, 8000, "TCP", False),
        ("egress", encoder, gateway, 8000, "TCP", False),
        ("both", pd, encoder, 8001, "TCP", True),
        *[("both", gateway, pd, port, "TCP", True) for port in (8000, 8001, 9000)],
        ("both", prometheus, encoder, 8002, "TCP", True),
        ("both", prometheus, pd, 8002, "TCP", True),
        ("both", encoder, dns, 53, "UDP", True),
    ]
    wrong = [
        f"{check}: {source.labels}@{source.namespace} -> {target.labels}@{target.namespace}:{port}/{protocol}: "
        f"{'denied' if want else 'allowed'}"
        for check, source, target, port, protocol, want in expected
        if allows(policies, source, target, port, protocol, check) != want
    ]
    assert not wrong, "\n".join(wrong)


def pod_spec_labels(deployment: dict[str, Any]) -> dict[str, str]:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"], labels)
    return labels


def test_the_network_policies_admit_only_the_callers_each_role_needs() -> None:
    check_network_policies(all_resources())


def test_every_app_pod_is_isolated_both_ways() -> None:
    resources = all_resources()
    for name in SERVERS:
        labels = pod_spec_labels(resources[("Deployment", name)])
        types = {
            kind
            for policy in network_policies(resources)
            if selects(policy["spec"]["podSelector"], labels)
            for kind in policy_types(policy["spec"])
        }
        assert types == {"Ingress", "Egress"}, name


def _policy(resources: dict[tuple[str, str], dict[str, Any]], name: str) -> dict[str, Any]:
    return resources[("NetworkPolicy", name)]["spec"]


def _no_egress(resources: dict[tuple[str, str], dict[str, Any]]) -> None:
    for policy in network_policies(resources):
        policy["spec"]["policyTypes"] = ["Ingress"]
        policy["spec"].pop("egress", None)


def _split_monitoring_peer(resources: dict[tuple[str, str], dict[str, Any]]) -> None:
    rule = _policy(resources, "triton-epd-encoder")["ingress"][1]
    (peer,) = rule["from"]
    rule["from"] = [{"namespaceSelector": peer["namespaceSelector"]}, {"podSelector": peer["podSelector"]}]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: _policy(r, "triton-epd-encoder")["ingress"][0]["from"][0]["podSelector"]["matchLabels"].pop(
            "app.kubernetes.io/component"
        ),
        lambda r: _policy(r, "triton-epd-encoder")["ingress"][0].pop("ports"),
        lambda r: _policy(r, "triton-epd-pd")["ingress"][0]["from"].append({"namespaceSelector": {}}),
        lambda r: _policy(r, "triton-epd-pd")["ingress"][0].pop("from"),
        lambda r: _policy(r, "triton-epd-pd")["podSelector"]["matchLabels"].update(
            {"app.kubernetes.io/component": "p-d"}
        ),
        _no_egress,
        _split_monitoring_peer,
        lambda r: _policy(r, "triton-epd-pd")["egress"][0]["ports"][0].update(port=8000),
    ],
    ids=[
        "encoder-from-any-app-pod",
        "encoder-all-ports",
        "pd-from-any-namespace",
        "pd-from-anyone",
        "pd-policy-selects-nothing",
        "no-egress-policy",
        "monitoring-peer-split",
        "pd-to-wrong-port",
    ],
)
def test_a_loosened_policy_fails_the_policy_check(
    mutate: Callable[[dict[tuple[str, str], dict[str, Any]]], Any],
) -> None:
    resources = copied(all_resources())
    mutate(resources)
    with pytest.raises(AssertionError):
        check_network_policies(resources)


# --- the manifests' shape and the launcher ------------------------------------------------------


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_against_the_kubernetes_schemas(path: Path) -> None:
    for doc in documents(path):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_broken_manifest_fails_validation() -> None:  # the check above can fail
    deployment = all_resources()[("Deployment", "triton-epd-encoder")]
    broken = copied(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_set_of_resources_the_issue_asks_for() -> None:
    resources = all_resources()
    encoder_service = resources[("Service", "triton-epd-encoder")]
    assert encoder_service["spec"]["clusterIP"] == "None"  # headless: one A record per ready pod
    assert ("Service", "triton-epd") in resources and ("ConfigMap", "triton-epd-target") in resources
    assert SECRET in resources
    hpa = resources[("HorizontalPodAutoscaler", "triton-epd-encoder")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "triton-epd-encoder"
    assert "queue" in hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    configmap = resources[("ConfigMap", "triton-epd-target")]["data"]
    assert configmap["REMOTE_ENCODERS"] == f"dns:{encoder_service['metadata']['name']}:8001"
    for name, role in SERVERS.items():
        container = server_container(resources[("Deployment", name)])
        assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
        assert {"cpu", "memory"} <= set(container["resources"]["requests"])
        parsed = k8s_server_args(resources[("Deployment", name)])
        assert parsed.role == role and parsed.node_id == f"{name}-0"
        assert parsed.host == "0.0.0.0"  # the probes and the other pods reach the pod's address
        assert str(parsed.cache_path) == configmap["CACHE_PATH"]
        assert parsed.remote_encoders == (configmap["REMOTE_ENCODERS"] if role == "pd" else None)


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in container args; an unknown variable fails the test."""

    def value(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is not in the container's environment"
        return env[match.group(1)]

    return [re.sub(r"\$\(([A-Z_]+)\)", value, arg) for arg in args]


# --- compose ------------------------------------------------------------------------------------


def compose_args(service: dict[str, Any]) -> Any:
    return launcher.parse_args([*entrypoint_args(DOCKER / "Dockerfile.cpu"), *service["command"]])


def check_compose_hardened(compose: dict[str, Any]) -> None:
    """Every service: read-only root file system with each path a start writes on a tmpfs or a
    volume, no capabilities, no privilege gain, the image's user, its keys as compose secrets."""
    dockerfile = DOCKER / "Dockerfile.cpu"
    secrets = compose.get("secrets", {})
    for name, service in compose["services"].items():
        assert service.get("read_only") is True, name
        assert service.get("cap_drop") == ["ALL"] and not service.get("cap_add"), name
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert not service.get("privileged"), name
        uid = str(service.get("user", "")).split(":")[0]
        assert uid == str(IMAGE_UID), f"{name}: user {service.get('user')!r}"
        mounts: dict[str, str] = {entry.split(":")[0]: "tmpfs" for entry in service.get("tmpfs", [])}
        for entry in service.get("volumes", []):
            parts = entry.split(":")
            if parts[-1] != "ro":
                mounts[parts[1] if len(parts) > 1 else parts[0]] = entry
        if service.get("shm_size"):
            mounts["/dev/shm"] = "shm_size"
        parsed = compose_args(service)
        home = image_env(dockerfile)["HOME"]
        for path, what in written_at_start(image_workdir(dockerfile), home, str(parsed.cache_path)).items():
            assert covering(path, mounts) is not None, f"{name}: {path} ({what}) is on the read-only root fs"
        for flag in KEY_FILE_READERS:
            if getattr(parsed, flag) is None:
                continue
            path = PurePosixPath(getattr(parsed, flag))
            assert path.parent == PurePosixPath("/run/secrets"), f"{name}: {flag} {path} is not a compose secret"
            assert path.name in service.get("secrets", []) and "file" in secrets.get(path.name, {}), f"{name}: {path}"


def test_the_compose_services_run_hardened() -> None:
    compose = compose_file()
    check_compose_hardened(compose)
    services = compose["services"]
    parsed = {name: compose_args(service) for name, service in services.items()}
    assert all(args.host == "0.0.0.0" for args in parsed.values())
    for name in ("encoder-a", "encoder-b"):
        keys = (parsed[name].admin_key_file, parsed[name].peer_key_file, parsed[name].tenant_secret_file)
        assert all(keys) and parsed[name].api_keys_file is None, name
        assert parsed[name].peer_key_file == parsed["pd"].peer_key_file  # what the PD server sends
    assert (parsed["pd"].openai_port, parsed["pd"].openai_host) == (9000, "0.0.0.0") and parsed["pd"].api_keys_file
    # The encoders are on an internal network only: the PD server reaches them, they reach nothing.
    assert compose["networks"]["encoders"]["internal"] is True
    assert all(services[name]["networks"] == ["encoders"] for name in ("encoder-a", "encoder-b"))
    assert "encoders" in services["pd"]["networks"]
    assert all(port.startswith("127.0.0.1:") for port in services["pd"]["ports"])  # published on loopback only
    assert not any("ports" in services[name] for name in ("encoder-a", "encoder-b"))


def test_the_compose_secrets_are_the_files_generate_sh_writes(tmp_path: Path) -> None:
    secrets = compose_file()["secrets"]
    generated = {path.name for path in generated_keys(tmp_path).iterdir()}
    assert {Path(secret["file"]).name for secret in secrets.values()} == set(secrets) == generated
    assert all((DOCKER / secret["file"]).parent == DOCKER / "secrets" for secret in secrets.values())


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s.pop("read_only"),
        lambda s: s.update(cap_drop=["NET_RAW"]),
        lambda s: s.update(security_opt=[]),
        lambda s: s.update(user="0:0"),
        lambda s: s.pop("user"),
        lambda s: s.update(tmpfs=[]),
        lambda s: s.update(volumes=s["volumes"][:1]),
        lambda s: s.update(secrets=[]),
    ],
    ids=[
        "rw-root",
        "caps-kept",
        "may-gain-privileges",
        "root",
        "no-user",
        "no-tmpfs",
        "no-repository-volume",
        "no-secrets",
    ],
)
def test_a_weakened_compose_service_fails_the_hardening_check(mutate: Callable[[dict[str, Any]], Any]) -> None:
    compose = copied(compose_file())
    mutate(compose["services"]["pd"])
    with pytest.raises(AssertionError):
        check_compose_hardened(compose)


def test_compose_file_has_two_encoders_and_one_pd_server_the_launcher_accepts() -> None:
    compose = compose_file()
    services = compose["services"]
    assert set(services) == {"encoder-a", "encoder-b", "pd"}
    parsed = {name: compose_args(service) for name, service in services.items()}
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
    services = compose_file()["services"]
    for name, service in services.items():
        assert compose_args(service).cpus == [service["cpuset"]], name
    assert services["encoder-a"]["cpuset"] != services["pd"]["cpuset"]
    for name in SERVERS:
        container = server_container(all_resources()[("Deployment", name)])
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        assert requests == limits and str(requests["cpu"]).isdigit(), name
