"""Render helm/kvstore offline and look into the result: helm-python-sdk (Helm as a library,
no binary, no cluster) renders; kubernetes-validate checks objects against the bundled
Kubernetes schemas. Imported only by the chart tests, which skip when these are missing.

Also what those tests share: the value sets (CASES) rendered on top of the chart's CI values
(helm/kvstore/ci/test-values.yaml: an image, since the chart refuses its placeholder), and
small readers of the rendered objects."""

from __future__ import annotations

import base64
import copy
import hashlib
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvstore.daemon.config import load_config

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "kvstore"
CI_VALUES_FILE = CHART_DIR / "ci" / "test-values.yaml"
RELEASE = "rel"
NAMESPACE = "kv"
FULLNAME = f"{RELEASE}-kvstore"
#: The oldest Kubernetes the chart supports (native gRPC probes are GA in 1.27); the
#: objects are validated against this minor's schemas.
KUBE_VERSION = "1.30.0"

_UNITS = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
          "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_bytes(text: str | int) -> int:
    """Bytes in a whole-number Kubernetes quantity ("8448Mi", "10Gi", "4096")."""
    match = re.fullmatch(r"(\d+)([A-Za-z]*)", str(text))
    assert match and match[2] in _UNITS, f"not a whole quantity: {text!r}"
    return int(match[1]) * _UNITS[match[2]]


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """over on top of base, maps merged key by key as Helm merges values files."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def ci_values(values: dict[str, Any]) -> dict[str, Any]:
    """values on top of the chart's CI values, as `helm install -f ci/test-values.yaml`."""
    return merged(yaml.safe_load(CI_VALUES_FILE.read_text()), values)


@dataclass
class Rendered:
    """One render of the chart: the raw template outputs and the objects in them."""

    files: dict[str, str]  #: template path -> rendered text (NOTES.txt included)
    objects: list[dict[str, Any]]  #: every Kubernetes object, in template order

    @property
    def notes(self) -> str:
        return next(text for path, text in self.files.items() if path.endswith("NOTES.txt"))

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [o for o in self.all(kind) if name is None or o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
        return found[0]

    def stream(self) -> str:
        """The manifests as `helm template` prints them: one YAML stream."""
        docs = [f"# Source: {path}\n{text.strip()}\n" for path, text in self.files.items()
                if not path.endswith("NOTES.txt") and text.strip()]
        return "---\n" + "---\n".join(docs)


def render(chart: Any, values: dict[str, Any], *, ci: bool = True) -> Rendered:
    """Render `chart` (a loaded helm_python.Chart) with `values` as an install would, on top
    of the CI values unless ci=False (the chart's own defaults alone)."""
    files = chart.render(ci_values(values) if ci else values, name=RELEASE, namespace=NAMESPACE,
                         is_install=True)
    objects = []
    for path, text in files.items():
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return Rendered(files=files, objects=objects)


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: dict[str, Any], name: str = "kvstore") -> dict[str, Any]:
    return next(c for c in pod_spec(workload)["containers"] if c["name"] == name)


def volume(workload: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((v for v in pod_spec(workload).get("volumes", []) if v["name"] == name), None)


def mount(ctr: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((m for m in ctr.get("volumeMounts", []) if m["name"] == name), None)


def workload(r: Rendered) -> dict[str, Any]:
    """The daemon's DaemonSet or StatefulSet."""
    [obj] = [o for o in r.objects if o["kind"] in ("DaemonSet", "StatefulSet")
             and o["metadata"]["name"] == FULLNAME]
    return obj


def daemon_config(r: Rendered, env: dict[str, str] | None = None) -> Any:
    """The rendered config file, loaded by the daemon's own loader (raises on any bad key)."""
    text = r.one("ConfigMap", FULLNAME)["data"]["kvstore.yaml"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(text)
        f.flush()
        return load_config(path=f.name, env=env or {})


def secret_data(secret: dict[str, Any], key: str) -> str:
    if key in secret.get("stringData", {}):
        return str(secret["stringData"][key])
    return base64.b64decode(secret["data"][key]).decode()


def tenants_of(r: Rendered) -> list[dict[str, Any]]:
    """The tenants of the generated tenants file."""
    text = secret_data(r.one("Secret", f"{FULLNAME}-tenants"), "tenants.yaml")
    return list(yaml.safe_load(text)["tenants"])


def admin_flags(command: list[str]) -> dict[str, str]:
    """--flag value pairs of a kvstore-admin command line (the verb and its flags excluded)."""
    flags = {}
    for i, word in enumerate(command):
        if word.startswith("--") and i + 1 < len(command) and not command[i + 1].startswith("--"):
            flags[word] = command[i + 1]
    return flags


# --- the value sets the chart tests render ------------------------------------------------

#: L3 opted into, as it must be (it is off by default): a node folder on a local NVMe.
L3_FOLDER = "/mnt/nvme0/kvstore"
L3_ON = {"nvme": {"enabled": True, "volume": {"hostPath": {"path": L3_FOLDER}}}}
#: L1 asked for, as it must be (off by default: it takes a GPU per node from the engines).
L1_ON = {"hbm": {"enabled": True}}

CPU_ONLY = {
    "image": {"variant": "cpu"},
    "hbm": {"enabled": False},
    "nodeSelector": None,  # null drops a default map key in Helm ({} would merge)
    "tolerations": [],
    "dram": {"size": "2Gi"},
    "nvme": {"enabled": True, "size": "8Gi", "volume": {"type": "emptyDir"}},
    "resources": {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"memory": "4Gi"}},
}
TEAM_A = {"name": "team-a", "tokens_sha256": [hashlib.sha256(b"token-a").hexdigest()],
          "namespaces": ["team-a/"], "role": "client",
          "quota": {"dram": "2GiB", "nvme": "20GiB", "pinned": "512MiB"}}
TEAM_B = {"name": "team-b", "identities": ["spiffe://cluster/ns/b/sa/engine", "engine-b"],
          "namespaces": ["team-b/", "shared/"], "role": "admin"}
NEXT_HASH = hashlib.sha256(b"the next token").hexdigest()
CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "cpu": CPU_ONLY,
    "gpu_gds": {
        **L1_ON,
        "auth": {"mode": "off"},  # hostIPC (the named /dev/shm segment) exists only without auth
        "nvme": merged(L3_ON["nvme"], {"gds": {"enabled": True}}),
        "dram": {"hostIPC": True},
        "service": {"internalTrafficPolicy": "Local"},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    },
    "statefulset": {
        "kind": "StatefulSet",
        "replicaCount": 3,
        "nvme": {"enabled": True, "size": "200Gi", "volume": {
            "type": "persistentVolumeClaim",
            "persistentVolumeClaim": {"storageClass": "local-nvme"}}},
    },
    "external_redis": {
        "remote": {"enabled": True, "address": "redis.cache.svc:6380", "tls": True, "db": 2,
                   "password": "s3cret", "prewarmSize": "4Gi"},
    },
    "bundled_redis": {
        "redis": {"enabled": True},
        "remote": {"password": "trial-pw"},
        "networkPolicy": {"enabled": True},
    },
    # The NetworkPolicy plus a Redis password from an existing Secret (gRPC auth is the default).
    "auth": {
        "networkPolicy": {"enabled": True, "metricsFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]},
        "remote": {"enabled": True, "address": "redis.cache.svc:6379",
                   "existingSecret": "redis-auth", "existingSecretPasswordKey": "password"},
    },
    "hostpath_statefulset_cpu": {**CPU_ONLY, "kind": "StatefulSet", "replicaCount": 2,
                                 "nvme": merged(L3_ON["nvme"], {"size": "8Gi"})},
    "auth_off": {"auth": {"mode": "off"}},
    "token_tls_tenants": {
        "tls": {"enabled": True, "secretName": "kv-tls", "serverName": "kvstore.example"},
        # Beside teams of their own, the chart's engine tenant takes a prefix nobody else owns.
        "auth": {"tenants": [TEAM_A, TEAM_B], "extraTokenHashes": [NEXT_HASH],
                 "engine": {"namespaces": ["engine/"]}},
    },
    "mtls_tls": {
        "auth": {"mode": "mtls", "tenants": [TEAM_B]},
        "tls": {"enabled": True, "secretName": "kv-tls"},
    },
    "existing_secret": {"auth": {"existingSecret": "kv-tenants"}},
    # L3 in a folder prepared on the nodes: no chown step; the kubelet only checks it exists.
    "prepared_l3_folder": {"volumePermissions": {"enabled": False},
                           "nvme": merged(L3_ON["nvme"], {"volume": {"hostPath": {
                               "type": "Directory"}}})},
    # Everything the metrics feed: ServiceMonitor, the Grafana dashboard and the alerting rules.
    "observability": {
        "metrics": {"serviceMonitor": {"enabled": True}},
        "grafana": {"dashboard": {"enabled": True, "namespace": NAMESPACE,
                                  "annotations": {"grafana_folder": "kvstore"}}},
        "prometheusRule": {"enabled": True, "additionalLabels": {"release": "prom"},
                           "alerts": {"dramFullEvicting": {"usedRatio": 0.9,
                                                           "evictionsPerSecond": 250}}},
    },
}
