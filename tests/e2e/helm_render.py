"""Render helm/kvstore offline and look into the result: helm-python-sdk (Helm as a library,
no binary, no cluster) renders; kubernetes-validate checks objects against the bundled
Kubernetes schemas. Imported only by the chart tests, which skip when these are missing."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "kvstore"
RELEASE = "rel"
NAMESPACE = "kv"
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


def render(chart: Any, values: dict[str, Any]) -> Rendered:
    """Render `chart` (a loaded helm_python.Chart) with `values` as an install would."""
    files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in files.items():
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return Rendered(files=files, objects=objects)


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def container(workload: dict[str, Any], name: str = "kvstore") -> dict[str, Any]:
    return next(c for c in pod_spec(workload)["containers"] if c["name"] == name)


def volume(workload: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((v for v in pod_spec(workload).get("volumes", []) if v["name"] == name), None)


def mount(ctr: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((m for m in ctr.get("volumeMounts", []) if m["name"] == name), None)
