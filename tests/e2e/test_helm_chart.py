"""The Helm chart helm/kvstore, rendered offline for several value sets: every object valid
against the Kubernetes schemas (strict), the rendered YAML lint-clean, the fields that matter
asserted (probes, volumes and sizes, resources, securityContext, labels and selectors), the
ConfigMap accepted by the daemon's own config loader, and bad values refused with the fix."""

from __future__ import annotations

import base64
import re
import tempfile
from typing import Any

import pytest
import yaml

from kvstore.daemon.config import ConfigError, load_config
from tests.e2e.helm_render import (
    CHART_DIR,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    REPO,
    Rendered,
    container,
    mount,
    pod_spec,
    quantity_bytes,
    render,
    volume,
)

try:
    import helm_python
    import kubernetes_validate
    from yamllint import linter
    from yamllint.config import YamlLintConfig
except ImportError as exc:  # the chart tools are in the test extra; without them, say which
    pytest.skip(f"chart tests need helm-python-sdk, kubernetes-validate and yamllint ({exc})",
                allow_module_level=True)

FULLNAME = f"{RELEASE}-kvstore"

CPU_ONLY = {
    "image": {"variant": "cpu"},
    "hbm": {"enabled": False},
    "nodeSelector": None,  # null drops a default map key in Helm ({} would merge)
    "tolerations": [],
    "dram": {"size": "2Gi"},
    "nvme": {"size": "8Gi", "volume": {"type": "emptyDir"}},
    "resources": {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"memory": "4Gi"}},
}
CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "cpu": CPU_ONLY,
    "gpu_gds": {
        "nvme": {"gds": {"enabled": True}},
        "dram": {"hostIPC": True},
        "service": {"internalTrafficPolicy": "Local"},
        "volumePermissions": {"enabled": True},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    },
    "statefulset": {
        "kind": "StatefulSet",
        "replicaCount": 3,
        "nvme": {"size": "200Gi", "volume": {
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
    # The daemon has no gRPC auth token: "auth on" is the NetworkPolicy plus a Redis password
    # from an existing Secret.
    "auth": {
        "networkPolicy": {"enabled": True, "metricsFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]},
        "remote": {"enabled": True, "address": "redis.cache.svc:6379",
                   "existingSecret": "redis-auth", "existingSecretPasswordKey": "password"},
    },
    "hostpath_statefulset_cpu": {**CPU_ONLY, "kind": "StatefulSet", "replicaCount": 2,
                                 "nvme": {"size": "8Gi", "volume": {"type": "hostPath"}}},
}


@pytest.fixture(scope="module")
def chart() -> Any:
    loaded = helm_python.Chart.load(CHART_DIR)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def rendered(chart: Any) -> dict[str, Rendered]:
    return {case: render(chart, values) for case, values in CASES.items()}


def workload(r: Rendered) -> dict[str, Any]:
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


# --- the chart as a whole ----------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_lint_is_clean(case: str) -> None:
    report = helm_python.lint(CHART_DIR, CASES[case], strict=True, namespace=NAMESPACE,
                              kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == [] and report["messages"] == [], report


@pytest.mark.parametrize("case", CASES)
def test_every_object_is_valid_kubernetes(rendered: dict[str, Rendered], case: str) -> None:
    for obj in rendered[case].objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema offline; test_service_monitor checks it
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        assert obj["metadata"]["namespace"] == NAMESPACE
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/name"] == "kvstore"


_YAMLLINT = YamlLintConfig("""
extends: default
rules:
  line-length: {max: 160}
  indentation: {spaces: consistent, indent-sequences: whatever}
  document-start: disable
  truthy: {allowed-values: ["true", "false"], check-keys: false}
""")


@pytest.mark.parametrize("case", CASES)
def test_rendered_yaml_is_lint_clean(rendered: dict[str, Rendered], case: str) -> None:
    problems = list(linter.run(rendered[case].stream(), _YAMLLINT))
    assert not problems, "\n".join(f"{p.line}: {p.desc} ({p.rule})" for p in problems)


def test_chart_files_are_lint_clean() -> None:
    for name in ("Chart.yaml", "values.yaml"):
        problems = list(linter.run((CHART_DIR / name).read_text(), _YAMLLINT))
        assert not problems, f"{name}: " + "; ".join(f"{p.line}: {p.desc}" for p in problems)


def _leaf_paths(values: Any, prefix: str = "") -> set[str]:
    if not isinstance(values, dict) or not values:
        return {prefix}
    return set().union(*(_leaf_paths(v, f"{prefix}.{k}" if prefix else k)
                         for k, v in values.items()))


def test_every_value_is_documented_in_values_and_readme(chart: Any) -> None:
    """Each values key has a `## @param` comment (on itself or on a free-form parent such as
    resources), no comment names a key that is gone, and the README table lists them all."""
    text = (CHART_DIR / "values.yaml").read_text()
    params = set(re.findall(r"^\s*## @param (\S+)", text, re.M))
    leaves = _leaf_paths(chart.values)
    undocumented = {p for p in leaves
                    if not any(p == d or p.startswith(d + ".") for d in params)}
    assert not undocumented, f"values without a @param comment: {sorted(undocumented)}"
    stale = {d for d in params if not any(p == d or p.startswith(d + ".") for p in leaves)}
    assert not stale, f"@param comments for keys that do not exist: {sorted(stale)}"
    readme = (CHART_DIR / "README.md").read_text()
    assert not {d for d in params if f"`{d}`" not in readme}, "README misses values"


def test_schema_rejects_unknown_keys(chart: Any) -> None:
    with pytest.raises(helm_python.HelmValuesError, match="szie"):
        chart.render({"dram": {"szie": "1Gi"}}, name=RELEASE, namespace=NAMESPACE)


# --- the daemon's config ----------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_configmap_is_accepted_by_the_daemon(rendered: dict[str, Rendered], case: str) -> None:
    r = rendered[case]
    cfg = daemon_config(r)
    wl = workload(r)
    ctr = container(wl)
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    # Probes and the Service reach the pod IP, so the daemon must listen on every address.
    assert cfg.server.host == "0.0.0.0" and cfg.metrics.host == "0.0.0.0"
    assert ports["grpc"] == cfg.server.port
    assert ports["metrics"] == cfg.metrics.port
    assert ctr["args"] == ["--config", "/etc/kvstore/kvstore.yaml"]
    assert mount(ctr, "config")["mountPath"] == "/etc/kvstore"
    if cfg.dram.enabled:
        assert mount(ctr, "shm")["mountPath"] == "/dev/shm"
    if cfg.nvme.enabled:
        assert mount(ctr, "l3")["mountPath"] == cfg.nvme.dir
    # The daemon refuses unknown KVSTORE_* variables: no Service links may inject them.
    assert pod_spec(wl)["enableServiceLinks"] is False
    assert all(not e["name"].startswith("KVSTORE_") or e["name"] == "KVSTORE_REMOTE_PASSWORD"
               for e in ctr["env"])


def test_default_config_values(rendered: dict[str, Rendered]) -> None:
    cfg = daemon_config(rendered["defaults"])
    assert (cfg.hbm.mode, cfg.dram.pin_memory) == ("on", True)
    assert cfg.dram.capacity_bytes == 8 << 30
    assert (cfg.nvme.capacity_bytes, cfg.nvme.backend) == (100 << 30, "auto")
    assert cfg.remote.url == ""
    assert (cfg.server.max_object_bytes, cfg.server.max_response_bytes) == (64 << 20, 1 << 30)
    assert (cfg.server.grace_s, cfg.server.drain_notice_s) == (5, 1)
    assert (cfg.server.max_streams, cfg.server.max_streams_per_connection) == (0, 0)


# --- value sets ---------------------------------------------------------------------------


def test_defaults_are_a_gpu_daemonset(rendered: dict[str, Rendered]) -> None:
    r = rendered["defaults"]
    wl = r.one("DaemonSet")
    spec = pod_spec(wl)
    ctr = container(wl)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} \
        in spec["tolerations"]
    assert ctr["image"] == "ghcr.io/example/kvstore:0.1.0-cuda"
    assert ctr["resources"]["limits"]["nvidia.com/gpu"] == 1
    # Probes: native gRPC on the health service; the startup probe allows a long start.
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert ctr[probe]["grpc"] == {"port": 50051}, probe
    startup = ctr["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    # /dev/shm: a memory emptyDir that covers L2, inside the memory limit.
    shm = volume(wl, "shm")["emptyDir"]
    assert shm["medium"] == "Memory"
    l2 = daemon_config(r).dram.capacity_bytes
    limit = quantity_bytes(ctr["resources"]["limits"]["memory"])
    assert l2 <= quantity_bytes(shm["sizeLimit"]) <= limit
    assert volume(wl, "l3")["hostPath"] == {"path": "/var/lib/kvstore", "type": "DirectoryOrCreate"}
    assert not {"hostIPC", "hostNetwork", "initContainers"} & spec.keys()


def test_restrictive_security_context(rendered: dict[str, Rendered]) -> None:
    wl = rendered["defaults"].one("DaemonSet")
    pod = pod_spec(wl)["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] == 10001
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(wl)["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    # Pinned L2 (pin_memory with a GPU) locks pages: IPC_LOCK and nothing else is added.
    assert sc["capabilities"]["add"] == ["IPC_LOCK"]
    assert pod_spec(wl)["automountServiceAccountToken"] is False


def test_cpu_only(rendered: dict[str, Rendered]) -> None:
    r = rendered["cpu"]
    wl = r.one("DaemonSet")
    ctr = container(wl)
    cfg = daemon_config(r)
    assert (cfg.hbm.mode, cfg.dram.pin_memory) == ("off", False)
    assert ctr["image"].endswith(":0.1.0-cpu")
    assert "nvidia.com/gpu" not in ctr["resources"]["limits"]
    assert "add" not in ctr["securityContext"]["capabilities"]
    assert "nodeSelector" not in pod_spec(wl) and "tolerations" not in pod_spec(wl)
    l3 = volume(wl, "l3")["emptyDir"]
    assert quantity_bytes(l3["sizeLimit"]) > cfg.nvme.capacity_bytes
    assert quantity_bytes(volume(wl, "shm")["emptyDir"]["sizeLimit"]) >= cfg.dram.capacity_bytes


def test_gpu_with_gds_and_host_ipc(rendered: dict[str, Rendered]) -> None:
    r = rendered["gpu_gds"]
    wl = r.one("DaemonSet")
    spec = pod_spec(wl)
    ctr = container(wl)
    assert daemon_config(r).nvme.backend == "kvikio"
    # GDS needs /dev/nvidia-fs*: privileged, switched on by nvme.gds.enabled only.
    sc = ctr["securityContext"]
    assert sc["privileged"] is True and sc["allowPrivilegeEscalation"] is True
    assert mount(ctr, "udev") == {"name": "udev", "mountPath": "/run/udev", "readOnly": True}
    # hostIPC: the node's /dev/shm, so engine pods on the node can map L2.
    assert spec["hostIPC"] is True
    assert volume(wl, "shm")["hostPath"] == {"path": "/dev/shm", "type": "Directory"}
    # The client's co-location check compares IPC namespaces: hostIPC alone makes them equal.
    assert "hostNetwork" not in spec
    [init] = spec["initContainers"]
    assert init["command"][:2] == ["chown", "-R"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert r.one("Service", FULLNAME)["spec"]["internalTrafficPolicy"] == "Local"
    assert "privileged" in r.notes and "hostIPC" in r.notes


def test_service_monitor(rendered: dict[str, Rendered]) -> None:
    r = rendered["gpu_gds"]
    sm = r.one("ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"] == r.one("Service", FULLNAME)["spec"]["selector"]
    assert sm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]
    assert not rendered["defaults"].all("ServiceMonitor")


def test_statefulset_mode(rendered: dict[str, Rendered]) -> None:
    r = rendered["statefulset"]
    assert not r.all("DaemonSet")
    sts = r.one("StatefulSet", FULLNAME)
    assert sts["spec"]["replicas"] == 3
    headless = r.one("Service", f"{FULLNAME}-headless")
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
    assert headless["spec"]["clusterIP"] == "None"
    [claim] = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "l3" and volume(sts, "l3") is None
    assert claim["spec"]["storageClassName"] == "local-nvme"
    size = quantity_bytes(claim["spec"]["resources"]["requests"]["storage"])
    assert size > daemon_config(r).nvme.capacity_bytes


def test_statefulset_replicas_on_one_node_get_their_own_l3_folder(
        rendered: dict[str, Rendered]) -> None:
    sts = rendered["hostpath_statefulset_cpu"].one("StatefulSet", FULLNAME)
    assert mount(container(sts), "l3")["subPathExpr"] == "$(POD_NAME)"


def test_labels_and_selectors_agree(rendered: dict[str, Rendered]) -> None:
    for case, r in rendered.items():
        wl = workload(r)
        selector = wl["spec"]["selector"]["matchLabels"]
        pod_labels = wl["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items(), case
        assert r.one("Service", FULLNAME)["spec"]["selector"] == selector, case
        assert r.one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == selector, case
        assert pod_spec(wl)["serviceAccountName"] == r.one("ServiceAccount")["metadata"]["name"]
        for obj in r.all("StatefulSet") + r.all("DaemonSet"):  # no other workload's pods match
            if obj is not wl:
                labels = obj["spec"]["template"]["metadata"]["labels"]
                assert not selector.items() <= labels.items(), case


def _password_env(ctr: dict[str, Any]) -> dict[str, Any]:
    [env] = [e for e in ctr["env"] if e["name"] == "KVSTORE_REMOTE_PASSWORD"]
    return env["valueFrom"]["secretKeyRef"]


def test_external_redis(rendered: dict[str, Rendered]) -> None:
    r = rendered["external_redis"]
    secret = r.one("Secret")
    assert base64.b64decode(secret["data"]["redis-password"]) == b"s3cret"
    ref = _password_env(container(r.one("DaemonSet")))
    assert ref == {"name": secret["metadata"]["name"], "key": "redis-password"}
    assert "s3cret" not in r.one("ConfigMap")["data"]["kvstore.yaml"]
    cfg = daemon_config(r, env={"KVSTORE_REMOTE_PASSWORD": "s3cret"})
    assert cfg.remote.url == "rediss://redis.cache.svc:6380/2"
    assert cfg.remote.password == "s3cret"
    assert cfg.remote.prewarm_bytes == 4 << 30
    assert not r.all("NetworkPolicy") and "no authentication" in r.notes
    assert "without a password" not in r.notes


def test_bundled_redis(rendered: dict[str, Rendered]) -> None:
    r = rendered["bundled_redis"]
    redis = r.one("StatefulSet", f"{FULLNAME}-redis")
    svc = r.one("Service", f"{FULLNAME}-redis")
    assert svc["spec"]["selector"] == redis["spec"]["selector"]["matchLabels"]
    assert daemon_config(r).remote.url == f"redis://{FULLNAME}-redis.{NAMESPACE}.svc:6379/0"
    ctr = container(redis, "redis")
    assert ctr["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert ctr["env"][0]["valueFrom"]["secretKeyRef"] == _password_env(container(workload(r)))
    assert ctr["securityContext"]["readOnlyRootFilesystem"] is True
    policies = {p["metadata"]["name"]: p for p in r.all("NetworkPolicy")}
    assert set(policies) == {FULLNAME, f"{FULLNAME}-redis"}
    [rule] = policies[f"{FULLNAME}-redis"]["spec"]["ingress"]
    assert rule["from"][0]["podSelector"]["matchLabels"] == \
        workload(r)["spec"]["selector"]["matchLabels"]
    assert "trials only" in r.notes


def test_auth_network_policy_and_existing_secret(rendered: dict[str, Rendered]) -> None:
    r = rendered["auth"]
    assert not r.all("Secret")
    assert _password_env(container(r.one("DaemonSet"))) == {"name": "redis-auth",
                                                             "key": "password"}
    policy = r.one("NetworkPolicy")
    grpc, metrics = policy["spec"]["ingress"]
    assert grpc["ports"] == [{"port": 50051, "protocol": "TCP"}]
    assert grpc["from"] == [{"podSelector": {"matchLabels": {f"{FULLNAME}-client": "true"}}}]
    assert metrics["from"][0]["namespaceSelector"]["matchLabels"] == \
        {"kubernetes.io/metadata.name": "monitoring"}
    # The helm test pod carries the client label, so the policy admits it.
    test_pod = r.one("Pod")
    assert test_pod["metadata"]["labels"][f"{FULLNAME}-client"] == "true"
    assert "no authentication" not in r.notes and "without a password" not in r.notes


def test_notes_warn_about_insecure_settings(chart: Any) -> None:
    r = render(chart, {"remote": {"enabled": True, "address": "redis:6379"}})
    assert "no authentication" in r.notes
    assert "Redis (L4) is used without a password" in r.notes
    assert f"kvstore-admin --target {FULLNAME}.{NAMESPACE}.svc:50051" in r.notes


def test_helm_test_pod_runs_admin_health(rendered: dict[str, Rendered]) -> None:
    pod = rendered["defaults"].one("Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    ctr = pod["spec"]["containers"][0]
    assert ctr["command"] == ["kvstore-admin"]
    assert ctr["args"][-1] == "health"
    assert ctr["args"][:2] == ["--target", f"{FULLNAME}.{NAMESPACE}.svc:50051"]
    assert ctr["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["spec"]["restartPolicy"] == "Never"


# --- bad values -------------------------------------------------------------------------

BAD_VALUES = {
    "negative size": ({"dram": {"size": "-1Gi"}}, helm_python.HelmValuesError,
                      r"/dram/size.*does not match pattern"),
    "L4 without an address": ({"remote": {"enabled": True}}, helm_python.HelmRenderError,
                              r"--set remote\.address="),
    "L3 without a volume": ({"nvme": {"volume": {"type": ""}}}, helm_python.HelmRenderError,
                            r"--set nvme\.volume\.type=hostPath"),
    "L2 over the memory limit": ({"dram": {"size": "16Gi"}}, helm_python.HelmRenderError,
                                 r"--set dram\.size=7680Mi"),
    "claim per daemon in a DaemonSet": ({"nvme": {"volume": {"type": "persistentVolumeClaim"}}},
                                        helm_python.HelmRenderError, r"--set kind=StatefulSet"),
    "unknown policy": ({"nvme": {"placement": "random"}}, helm_python.HelmValuesError,
                       r"/nvme/placement"),
    "GDS on the CPU image": ({"image": {"variant": "cpu"}, "nvme": {"gds": {"enabled": True}}},
                             helm_python.HelmRenderError, r"--set image\.variant=cuda"),
    "drain notice past the grace": ({"server": {"drainNoticeSeconds": 9}},
                                    helm_python.HelmRenderError,
                                    r"--set server\.drainNoticeSeconds=1"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_bad_values_are_refused_with_the_fix(chart: Any, case: str) -> None:
    values, error, message = BAD_VALUES[case]
    with pytest.raises(error, match=message):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_daemon_loader_catches_a_bad_key_in_extra_config(chart: Any) -> None:
    """extraConfig goes to the daemon as is: a typo there is the daemon's to report."""
    r = render(chart, {"extraConfig": {"movers": {"high_watermrk": 0.8}}})
    with pytest.raises(ConfigError, match="did you mean movers.high_watermark"):
        daemon_config(r)
    ok = render(chart, {"extraConfig": {"movers": {"high_watermark": 0.8}}})
    assert daemon_config(ok).movers.high_watermark == 0.8


def test_readme_documents_deploy_guide() -> None:
    guide = (REPO / "docs" / "kubernetes.md").read_text()
    for topic in ("helm install", "hostIPC", "helm upgrade", "kvstore-admin", "NetworkPolicy"):
        assert topic in guide, topic
    assert yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["name"] == "kvstore"
