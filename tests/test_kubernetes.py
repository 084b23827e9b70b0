"""The Kubernetes manifests (deploy/kubernetes/, docs/kubernetes.md): every overlay renders with ``kubectl
kustomize``, every object it makes holds to the Kubernetes OpenAPI schemas (kubernetes-validate, strict: an
unknown field fails), and the objects fit together as a cluster would need them to: each reference finds its
Secret key, ConfigMap, claim and port; each Service and monitor selects pods; and each daemon's environment
and configuration file is one that spikehound itself loads without an error.

The Prometheus Operator's PodMonitor and ServiceMonitor are custom resources whose schemas come with the
operator, not with Kubernetes: they are held to the objects they select instead.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from spikehound.config import ENV_PREFIX, load

ROOT = Path(__file__).resolve().parents[1]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUSTOMIZE / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
# The oldest Kubernetes release still maintained upstream when this was written, and the newest schemas shipped.
VERSIONS = ("1.32", kubernetes_validate.latest_version())
PROFILING = {"profiling", "production"}  # the overlays that may use the node's PIDs and ptrace
# What the image sets (deploy/container/Containerfile): part of every daemon's environment.
IMAGE_ENV = {"SPIKEHOUND_DATA_DIR": "/var/lib/spikehound", "SPIKEHOUND_AGENT_SPOOL_DIR": "/var/spool/spikehound"}
SECRET_VALUES = {"database-url": "postgresql://spikehound:pw@postgres.example.internal:5432/spikehound",
                 "slack-webhook-url": "https://hooks.slack.com/services/T000/B000/XXXX"}
Obj = dict[str, Any]

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="kubectl not installed (apt-get install kubernetes-client): the overlays are "
                                       "rendered with kubectl kustomize")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    """Each overlay's objects, rendered from a copy whose secrets.env files are filled in as their examples say."""
    tree = tmp_path_factory.mktemp("kubernetes") / "kubernetes"
    shutil.copytree(KUSTOMIZE, tree, ignore=shutil.ignore_patterns("secrets.env"))
    for example in tree.rglob("secrets.env.example"):
        lines = []
        for line in example.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep and not line.startswith("#"):
                line = f"{key}={value or SECRET_VALUES.get(key, f'{key}-value-0123456789abcdef')}"
            lines.append(line)
        example.with_name("secrets.env").write_text("\n".join(lines) + "\n")
    out = {}
    for overlay in OVERLAYS:
        done = subprocess.run(["kubectl", "kustomize", str(tree / "overlays" / overlay)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, f"overlays/{overlay}: {done.stderr}"
        out[overlay] = [o for o in yaml.safe_load_all(done.stdout) if o]
    return out


def _pods(objects: list[Obj]) -> list[tuple[Obj, Obj]]:
    """(workload, pod spec) of every workload with a pod template."""
    return [(o, o["spec"]["template"]["spec"]) for o in objects if "template" in o.get("spec", {})]


def _containers(spec: Obj) -> list[Obj]:
    return spec.get("initContainers", []) + spec["containers"]


def _daemon(container: Obj) -> str | None:
    """``collector`` or ``agent`` for a container that runs one."""
    args = container.get("args") or []
    return args[0] if container.get("command") is None and args and args[0] in ("collector", "agent") else None


def _named(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} rendered"
    return found[0]


def _secret(objects: list[Obj], name: str, key: str) -> str:
    secret = _named(objects, "Secret", name)
    assert key in secret.get("data", {}), f"Secret {name} has no key {key}"
    return base64.b64decode(secret["data"][key]).decode()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_holds_to_the_kubernetes_schemas(rendered: dict[str, list[Obj]], overlay: str):
    custom = set()
    for obj in rendered[overlay]:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            custom.add(obj["kind"])
            continue
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{overlay}: {obj['kind']} {obj['metadata']['name']} (Kubernetes {version}): "
                                     f"{'.'.join(map(str, exc.path))}: {exc.message}") from None
    assert custom <= {"PodMonitor", "ServiceMonitor"}, custom


def test_the_images_are_this_version(rendered: dict[str, list[Obj]]):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for overlay, objects in rendered.items():
        for _, spec in _pods(objects):
            assert {c["image"] for c in _containers(spec)} == {f"localhost/spikehound:{version}"}, overlay


def test_the_validator_refuses_what_kubernetes_would(rendered: dict[str, list[Obj]]):
    daemonset = _named(rendered["sqlite"], "DaemonSet", "spikehound-agent")
    broken = yaml.safe_load(yaml.safe_dump(daemonset))
    broken["spec"]["template"]["spec"]["hostPIDs"] = True  # a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_find_what_they_name(rendered: dict[str, list[Obj]], overlay: str):
    objects = rendered[overlay]
    namespaces = {o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"}
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") in namespaces, f"{obj['kind']} {obj['metadata']['name']}"
    for workload, spec in _pods(objects):
        for container in _containers(spec):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    _secret(objects, ref["name"], ref["key"])
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                _named(objects, "ConfigMap", volume["configMap"]["name"])
            if "secret" in volume:
                _named(objects, "Secret", volume["secret"]["secretName"])
            if "persistentVolumeClaim" in volume:
                _named(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        if workload["kind"] == "StatefulSet":
            assert _named(objects, "Service", workload["spec"]["serviceName"])["spec"]["clusterIP"] == "None"

    def ports_of_selected(selector: dict[str, str]) -> set[str]:
        pods = [spec for _, spec in _pods(objects)
                if selector.items() <= spec_labels(spec).items()]
        assert pods, f"{selector} selects no pods"
        return {p["name"] for spec in pods for c in spec["containers"] for p in c.get("ports", [])}

    labels = {id(spec): w["spec"]["template"]["metadata"]["labels"] for w, spec in _pods(objects)}

    def spec_labels(spec: Obj) -> dict[str, str]:
        return labels[id(spec)]

    for obj in objects:
        if obj["kind"] == "Service":
            named = ports_of_selected(obj["spec"]["selector"])
            assert {p["targetPort"] for p in obj["spec"]["ports"]} <= named, obj["metadata"]["name"]
        elif obj["kind"] == "PodMonitor":
            named = ports_of_selected(obj["spec"]["selector"]["matchLabels"])
            assert {e["port"] for e in obj["spec"]["podMetricsEndpoints"]} <= named
        elif obj["kind"] == "ServiceMonitor":
            services = [s for s in objects if s["kind"] == "Service" and obj["spec"]["selector"]["matchLabels"].items()
                        <= s["metadata"].get("labels", {}).items()]
            assert {e["port"] for e in obj["spec"]["endpoints"]} <= {p["name"] for s in services
                                                                      for p in s["spec"]["ports"]}
            for endpoint in obj["spec"]["endpoints"]:
                credentials = endpoint["authorization"]["credentials"]
                _secret(objects, credentials["name"], credentials["key"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_daemon_is_probed_bounded_and_locked_down(rendered: dict[str, list[Obj]], overlay: str):
    daemons = set()
    for workload, spec in _pods(rendered[overlay]):
        assert spec.get("hostPID", False) == (overlay in PROFILING and workload["kind"] == "DaemonSet")
        for container in _containers(spec):
            resources = container["resources"]
            assert {"cpu", "memory"} <= resources["requests"].keys() & resources["limits"].keys(), container["name"]
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
            assert security["capabilities"]["drop"] == ["ALL"]
            added = set(security["capabilities"].get("add", []))
            daemon = _daemon(container)
            if daemon is None:
                continue
            daemons.add(daemon)
            assert added == ({"SYS_PTRACE"} if overlay in PROFILING and daemon == "agent" else set()), added
            assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
            if daemon == "agent":
                assert workload["kind"] == "DaemonSet" and "nvidia.com/gpu.present" in spec["nodeSelector"]
                host_ports = {p.get("hostPort") for p in container["ports"]}
                assert {4317, 4318} <= host_ports
                assert spec.get("runtimeClassName") == ("nvidia" if overlay == "production" else None)
            else:
                assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 10001
    assert daemons == {"collector", "agent"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_daemon_loads_its_environment_and_configuration(rendered: dict[str, list[Obj]], overlay: str,
                                                              tmp_path: Path):
    objects = rendered[overlay]
    for workload, spec in _pods(objects):
        for container in spec["containers"]:
            daemon = _daemon(container)
            if daemon is None:
                continue
            env = dict(IMAGE_ENV)
            for item in container.get("env", []):
                source = item.get("valueFrom", {})
                if "secretKeyRef" in source:
                    env[item["name"]] = _secret(objects, source["secretKeyRef"]["name"], source["secretKeyRef"]["key"])
                elif "fieldRef" in source:
                    env[item["name"]] = f"{workload['metadata']['name']}-0"  # a pod's or node's name
                else:
                    env[item["name"]] = item["value"]
            path = env.get("SPIKEHOUND_CONFIG")
            if path:  # the file as the pod sees it: a key of a mounted ConfigMap
                (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
                (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
                config_map = _named(objects, "ConfigMap", volume["configMap"]["name"])
                env["SPIKEHOUND_CONFIG"] = str(tmp_path / f"{daemon}.toml")
                Path(env["SPIKEHOUND_CONFIG"]).write_text(config_map["data"][mount["subPath"]])
            assert any(k.startswith(ENV_PREFIX) for k in env)
            cfg = load(env=env)  # an unknown variable or a bad value raises, naming it
            if daemon == "agent":
                assert str(cfg.agent.otlp_grpc) == "0.0.0.0:4317" and cfg.agent.collector_token
                assert cfg.agent.profiling == (overlay in PROFILING)
            else:
                assert cfg.collector.otlp_token and cfg.collector.api_token
                assert cfg.cluster.enabled == (workload["kind"] == "StatefulSet")
