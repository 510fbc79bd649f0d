"""The Helm chart helm/kvstore, rendered offline for several value sets: every object valid
against the Kubernetes schemas (strict), the rendered YAML lint-clean, the fields that matter
asserted (probes, volumes and sizes, resources, securityContext, labels and selectors, auth:
tenants file, token, TLS, Unix socket, hostIPC), the ConfigMap accepted by the daemon's own
config loader, and bad values refused with the fix."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstore.daemon.l3room import Space, capacity_problem
from tests.e2e.helm_render import (
    CASES,
    CHART_DIR,
    FULLNAME,
    KUBE_VERSION,
    L1_ON,
    L3_FOLDER,
    L3_ON,
    NAMESPACE,
    NEXT_HASH,
    RELEASE,
    REPO,
    TEAM_A,
    TEAM_B,
    Rendered,
    admin_flags,
    ci_values,
    container,
    daemon_config,
    mount,
    pod_spec,
    quantity_bytes,
    render,
    secret_data,
    tenants_of,
    volume,
    workload,
)

try:
    import helm_python
    import kubernetes_validate
    from yamllint import linter
    from yamllint.config import YamlLintConfig
except ImportError as exc:  # the chart tools are in the test extra; without them, say which
    pytest.skip(f"chart tests need helm-python-sdk, kubernetes-validate and yamllint ({exc})",
                allow_module_level=True)

def _guide() -> str:
    return (REPO / "docs" / "kubernetes.md").read_text()


@pytest.fixture(scope="module")
def chart() -> Any:
    loaded = helm_python.Chart.load(CHART_DIR)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def rendered(chart: Any) -> dict[str, Rendered]:
    return {case: render(chart, values) for case, values in CASES.items()}


# --- the chart as a whole ----------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_lint_is_clean(case: str) -> None:
    # As `helm lint helm/kvstore -f helm/kvstore/ci/test-values.yaml` (and chart-testing) lint it.
    report = helm_python.lint(CHART_DIR, ci_values(CASES[case]), strict=True,
                              namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}")
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
    assert {e["name"] for e in ctr["env"] if e["name"].startswith("KVSTORE_")} <= \
        {"KVSTORE_REMOTE_PASSWORD", "KVSTORE_SERVER_UNIX_SOCKET"}
    # Every file the config names is mounted from where the chart put it.
    files = [cfg.auth.tenants_file, cfg.server.tls_cert_file, cfg.server.tls_key_file,
             cfg.server.tls_client_ca_file, cfg.server.unix_socket]
    folders = {m["mountPath"] for m in ctr["volumeMounts"]}
    assert all(f.rsplit("/", 1)[0] in folders for f in files if f), files


def test_default_config_values(rendered: dict[str, Rendered]) -> None:
    cfg = daemon_config(rendered["defaults"])
    # L1 and L3 are opt-in: no GPU taken from the engines, no file on a disk nobody chose.
    assert (cfg.hbm.mode, cfg.dram.pin_memory, cfg.nvme.enabled) == ("off", False, False)
    assert cfg.dram.capacity_bytes == 8 << 30
    assert (cfg.nvme.capacity_bytes, cfg.nvme.backend) == (32 << 30, "auto")
    assert cfg.remote.url == ""
    assert (cfg.server.max_object_bytes, cfg.server.max_response_bytes) == (64 << 20, 1 << 30)
    assert (cfg.server.grace_s, cfg.server.drain_notice_s) == (5, 1)
    assert (cfg.server.max_streams, cfg.server.max_streams_per_connection) == (0, 0)


# --- value sets ---------------------------------------------------------------------------


def test_defaults_are_a_daemonset_on_gpu_nodes(rendered: dict[str, Rendered]) -> None:
    r = rendered["defaults"]
    wl = r.one("DaemonSet")
    spec = pod_spec(wl)
    ctr = container(wl)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} \
        in spec["tolerations"]
    assert ctr["image"] == "localhost:5000/kvstore:0.1.0-cuda"  # ci/test-values.yaml's
    # On the GPU nodes, beside the engines, but holding none of their GPUs (finding 3).
    assert "nvidia.com/gpu" not in ctr["resources"]["limits"]
    assert "nvidia.com/gpu" not in ctr["resources"].get("requests", {})
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
    assert volume(wl, "l3") is None and mount(ctr, "l3") is None  # L3 is opt-in
    assert not {"hostIPC", "hostNetwork"} & spec.keys()
    # Auth is on by default: one init container readies the Unix socket's folder.
    assert [c["name"] for c in spec["initContainers"]] == ["socket-dir"]


def test_restrictive_security_context(rendered: dict[str, Rendered]) -> None:
    wl = rendered["defaults"].one("DaemonSet")
    pod = pod_spec(wl)["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] == 10001
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(wl)["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert "add" not in sc["capabilities"]  # L1 off: L2 is not pinned, nothing to lock
    assert pod_spec(wl)["automountServiceAccountToken"] is False
    # Pinned L2 (pin_memory with a GPU) locks pages: IPC_LOCK and nothing else is added.
    gpu = container(rendered["gpu_gds"].one("DaemonSet"))["securityContext"]
    assert gpu["capabilities"]["add"] == ["IPC_LOCK"]


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
    # The volume leaves the daemon's start-up check room for the file, its manifest and
    # the free space it keeps on the filesystem.
    size = quantity_bytes(l3["sizeLimit"])
    assert not capacity_problem(cfg.nvme.capacity_bytes, cfg.nvme.page_size_bytes,
                                cfg.nvme.compact_after_records, Space(size, size), 0, Path("/l3"))
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
    [init] = spec["initContainers"]  # auth off: no socket folder, only L3's
    assert init["command"] == ["chown", "-R", "10001:10001", "/var/lib/kvstore/l3"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert r.one("Service", FULLNAME)["spec"]["internalTrafficPolicy"] == "Local"
    assert "privileged" in r.notes and "hostIPC" in r.notes
    # L1 asked for: the daemon takes its GPU, and NOTES says the engines lose it.
    assert ctr["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert daemon_config(r).hbm.mode == "on" and daemon_config(r).dram.pin_memory
    assert "each daemon holds 1 nvidia.com/gpu of its node, which engines cannot use" in r.notes


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
    # Replicas are not one per node: the Service routes cluster-wide unless told otherwise.
    assert r.one("Service", FULLNAME)["spec"]["internalTrafficPolicy"] == "Cluster"
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
    secret = r.one("Secret", FULLNAME)
    assert base64.b64decode(secret["data"]["redis-password"]) == b"s3cret"
    ref = _password_env(container(r.one("DaemonSet")))
    assert ref == {"name": secret["metadata"]["name"], "key": "redis-password"}
    assert "s3cret" not in r.one("ConfigMap")["data"]["kvstore.yaml"]
    cfg = daemon_config(r, env={"KVSTORE_REMOTE_PASSWORD": "s3cret"})
    assert cfg.remote.url == "rediss://redis.cache.svc:6380/2"
    assert cfg.remote.password == "s3cret"
    assert cfg.remote.prewarm_bytes == 4 << 30
    assert not r.all("NetworkPolicy") and "no authentication" not in r.notes
    assert "metrics port 9400 is unauthenticated" in r.notes
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
    assert {s["metadata"]["name"] for s in r.all("Secret")} == \
        {f"{FULLNAME}-token", f"{FULLNAME}-engine-token", f"{FULLNAME}-tenants"}  # none for Redis
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
    r = render(chart, {"auth": {"mode": "off"},
                       "remote": {"enabled": True, "address": "redis:6379"}})
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


# --- auth: tenants, token, TLS, the Unix socket ------------------------------------------


def _mode_of(case: str) -> str:
    return str(CASES[case].get("auth", {}).get("mode", "token"))


def test_token_is_the_default(rendered: dict[str, Rendered]) -> None:
    """Defaults: token mode, a generated token whose sha256 is tenant default's only hash,
    the tenants file mounted read-only where the config points, and the preStop drain
    authenticated with the token file."""
    r = rendered["defaults"]
    cfg = daemon_config(r)
    assert (cfg.auth.mode, cfg.auth.tenants_file) == ("token", "/etc/kvstore-auth/tenants.yaml")
    token = secret_data(r.one("Secret", f"{FULLNAME}-token"), "token")
    assert len(token) >= 43 and token.isalnum()
    assert tenants_of(r)[0] == {"name": "default", "role": "admin", "namespaces": [],
                                "tokens_sha256": [hashlib.sha256(token.encode()).hexdigest()]}
    assert token not in r.one("ConfigMap")["data"]["kvstore.yaml"]
    wl = workload(r)
    ctr = container(wl)
    assert volume(wl, "tenants")["secret"] == {
        "secretName": f"{FULLNAME}-tenants", "defaultMode": 0o440,
        "items": [{"key": "tenants.yaml", "path": "tenants.yaml"}]}
    assert mount(ctr, "tenants") == {"name": "tenants", "mountPath": "/etc/kvstore-auth",
                                     "readOnly": True}
    assert volume(wl, "token")["secret"]["secretName"] == f"{FULLNAME}-token"
    drain = ctr["lifecycle"]["preStop"]["exec"]["command"]
    assert drain[0] == "kvstore-admin" and drain[-2:] == ["drain", "--wait"]
    assert admin_flags(drain) == {"--target": "127.0.0.1:50051",
                                   "--token-file": "/etc/kvstore-token/token"}
    assert "checksum/tenants" in wl["spec"]["template"]["metadata"]["annotations"]
    # Health needs no credentials: the probes stay the kubelet's own gRPC probes.
    assert ctr["readinessProbe"]["grpc"] == {"port": 50051}
    notes = r.notes
    assert f"get secret {FULLNAME}-engine-token -o jsonpath='{{.data.token}}' | base64 -d" \
        in notes
    assert "KVSTORE_TOKEN_FILE" in notes and "tokens cross the network in clear" in notes
    assert "auth.mode=off" not in notes


def test_unix_socket_replaces_host_ipc(rendered: dict[str, Rendered]) -> None:
    """With auth on, co-located clients get memfds over the Unix socket in a node folder;
    the pod does not share the node's IPC namespace."""
    r = rendered["defaults"]
    wl = workload(r)
    spec = pod_spec(wl)
    assert daemon_config(r).server.unix_socket == "/run/kvstore/kvstore.sock"
    assert volume(wl, "socket")["hostPath"] == {"path": "/run/kvstore", "type": "DirectoryOrCreate"}
    assert mount(container(wl), "socket")["mountPath"] == "/run/kvstore"
    init = spec["initContainers"][0]
    assert init["command"] == ["chown", "10001:10001", "/run/kvstore"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert mount(init, "socket")["mountPath"] == "/run/kvstore"
    assert "hostIPC" not in spec and "emptyDir" in volume(wl, "shm")
    assert "hostPath: {path: /run/kvstore, type: Directory}" in r.notes


@pytest.mark.parametrize("case", CASES)
def test_host_ipc_only_with_auth_off(rendered: dict[str, Rendered], case: str) -> None:
    spec = pod_spec(workload(rendered[case]))
    wants = _mode_of(case) == "off" and CASES[case].get("dram", {}).get("hostIPC", False)
    assert spec.get("hostIPC", False) is wants
    assert (volume(workload(rendered[case]), "socket") is None) is (_mode_of(case) == "off")


def test_statefulset_replicas_each_bind_their_own_socket(rendered: dict[str, Rendered]) -> None:
    """Replicas may share a node, hence the socket folder: the socket is named after the pod."""
    r = rendered["statefulset"]
    env = container(workload(r))["env"]
    names = [e["name"] for e in env]
    assert {"name": "KVSTORE_SERVER_UNIX_SOCKET", "value": "/run/kvstore/$(POD_NAME).sock"} in env
    assert names.index("POD_NAME") < names.index("KVSTORE_SERVER_UNIX_SOCKET")
    assert daemon_config(r).server.unix_socket == ""
    cfg = daemon_config(r, env={"KVSTORE_SERVER_UNIX_SOCKET": "/run/kvstore/rel-kvstore-0.sock"})
    assert cfg.server.unix_socket == "/run/kvstore/rel-kvstore-0.sock"


def test_auth_off_is_loud(rendered: dict[str, Rendered]) -> None:
    r = rendered["auth_off"]
    cfg = daemon_config(r)
    assert (cfg.auth.mode, cfg.auth.tenants_file, cfg.server.unix_socket) == ("off", "", "")
    assert not r.all("Secret")
    wl = workload(r)
    ctr = container(wl)
    assert {"tenants", "token", "socket", "tls"}.isdisjoint(
        v["name"] for v in pod_spec(wl)["volumes"])
    assert "initContainers" not in pod_spec(wl)  # no socket folder, and L3 is off
    assert admin_flags(ctr["lifecycle"]["preStop"]["exec"]["command"]) == \
        {"--target": "127.0.0.1:50051"}
    assert "WARNING: auth.mode=off: the gRPC endpoint has no authentication" in r.notes
    assert "--set auth.mode=token" in r.notes and "--set networkPolicy.enabled=true" in r.notes


def test_yaml_off_read_as_false_means_off(chart: Any) -> None:
    """`mode: off` unquoted in a values file is YAML 1.1 false; the chart takes it as off."""
    r = render(chart, {"auth": {"mode": False}})
    assert daemon_config(r).auth.mode == "off"
    assert not r.all("Secret")


def test_extra_tenants_and_tls(rendered: dict[str, Rendered]) -> None:
    """auth.tenants go into tenants.yaml as they are, after tenant default (which also takes
    the rotation hashes); TLS mounts the Secret and moves the probes into the container."""
    r = rendered["token_tls_tenants"]
    default, engine, *rest = tenants_of(r)
    token = secret_data(r.one("Secret", f"{FULLNAME}-token"), "token")
    assert default["tokens_sha256"] == [hashlib.sha256(token.encode()).hexdigest(), NEXT_HASH]
    assert rest == [TEAM_A, TEAM_B]
    assert default["namespaces"] == []  # "" would overlap the tenants' own prefixes
    assert (engine["name"], engine["namespaces"]) == ("engine", ["engine/"])
    # The daemon takes the file as rendered: its own parser, its own rules.
    from kvstore.core.tenants import parse_tenants
    assert parse_tenants({"tenants": [default, engine, *rest]}).names() == [
        "default", "engine", *(t["name"] for t in rest)]
    for case in rendered.values():
        if case.all("Secret") and any(
                s["metadata"]["name"] == f"{FULLNAME}-tenants" for s in case.all("Secret")):
            parse_tenants({"tenants": tenants_of(case)})
    cfg = daemon_config(r)
    assert (cfg.server.tls_cert_file, cfg.server.tls_key_file) == \
        ("/etc/kvstore-tls/tls.crt", "/etc/kvstore-tls/tls.key")
    assert cfg.server.tls_client_ca_file == ""  # token over TLS: no client certificates
    wl = workload(r)
    ctr = container(wl)
    inits = [c["name"] for c in pod_spec(wl)["initContainers"]]
    assert inits == ["socket-dir"]
    assert volume(wl, "tls")["secret"] == {"secretName": "kv-tls", "defaultMode": 0o440}
    tls_flags = {"--tls-ca": "/etc/kvstore-tls/ca.crt", "--tls-server-name": "kvstore.example"}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = ctr[probe]["exec"]["command"]
        assert "grpc" not in ctr[probe] and command[-1] == "health", probe
        assert admin_flags(command) == {"--target": "127.0.0.1:50051",
                                         "--timeout": str(ctr[probe]["timeoutSeconds"]),
                                         **tls_flags}, probe
    assert admin_flags(ctr["lifecycle"]["preStop"]["exec"]["command"]) == {
        "--target": "127.0.0.1:50051", **tls_flags, "--token-file": "/etc/kvstore-token/token"}
    # The helm test pod gets the CA and nothing else of the TLS Secret.
    test_pod = r.one("Pod")
    assert test_pod["spec"]["volumes"][-1]["secret"] == {
        "secretName": "kv-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert admin_flags(test_pod["spec"]["containers"][0]["args"])["--tls-ca"] == \
        "/etc/kvstore-tls/ca.crt"
    assert "in clear" not in r.notes and "KVSTORE_TLS_CA_FILE" in r.notes


def test_mtls(rendered: dict[str, Rendered]) -> None:
    r = rendered["mtls_tls"]
    cfg = daemon_config(r)
    assert cfg.auth.mode == "mtls"
    assert cfg.server.tls_client_ca_file == "/etc/kvstore-tls/ca.crt"
    # No token in mtls: the tenants file holds the listed tenants only, and the pod holds no
    # admin credential, so SIGTERM alone drains.
    assert tenants_of(r) == [TEAM_B]
    assert [s["metadata"]["name"] for s in r.all("Secret")] == [f"{FULLNAME}-tenants"]
    wl = workload(r)
    assert volume(wl, "token") is None and "lifecycle" not in container(wl)
    assert "exec" in container(wl)["livenessProbe"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        # Every mtls handshake needs a client certificate: the probes present the daemon's.
        flags = admin_flags(container(wl)[probe]["exec"]["command"])
        assert (flags["--tls-cert"], flags["--tls-key"]) == (
            "/etc/kvstore-tls/tls.crt", "/etc/kvstore-tls/tls.key"), probe
    test_pod = r.one("Pod")  # helm test: the same pair, so its handshake succeeds too
    assert [i["key"] for i in test_pod["spec"]["volumes"][-1]["secret"]["items"]] == [
        "ca.crt", "tls.crt", "tls.key"]
    assert admin_flags(test_pod["spec"]["containers"][0]["args"])["--tls-cert"] == \
        "/etc/kvstore-tls/tls.crt"
    assert "KVSTORE_TLS_CERT_FILE" in r.notes and "no preStop drain" in r.notes


def test_existing_tenants_secret(rendered: dict[str, Rendered]) -> None:
    r = rendered["existing_secret"]
    assert not r.all("Secret")
    wl = workload(r)
    assert volume(wl, "tenants")["secret"]["secretName"] == "kv-tenants"
    assert volume(wl, "tenants")["secret"]["items"] == [{"key": "tenants.yaml",
                                                         "path": "tenants.yaml"}]
    assert volume(wl, "token") is None and "lifecycle" not in container(wl)
    assert "checksum/tenants" not in wl["spec"]["template"]["metadata"]["annotations"]
    assert daemon_config(r).auth.tenants_file == "/etc/kvstore-auth/tenants.yaml"
    assert "Secret kv-tenants" in r.notes


def test_tenant_changes_restart_pods_only_when_a_restart_is_needed(chart: Any) -> None:
    """New tenants and quota changes roll the pods; a new hash waits for SIGHUP."""
    def checksum(tenants: list[dict[str, Any]]) -> str:
        wl = workload(render(chart, {"auth": {"tenants": tenants, "engine": {"enabled": False}}}))
        return wl["spec"]["template"]["metadata"]["annotations"]["checksum/tenants"]

    base = checksum([TEAM_A])
    rotated = {**TEAM_A, "tokens_sha256": TEAM_A["tokens_sha256"] + [NEXT_HASH]}
    assert checksum([rotated]) == base
    assert checksum([{**TEAM_A, "namespaces": ["team-a/", "x/"], "role": "admin"}]) == base
    assert checksum([{**TEAM_A, "quota": {"dram": "4GiB"}}]) != base
    assert checksum([TEAM_A, TEAM_B]) != base


# --- bad values -------------------------------------------------------------------------

BAD_VALUES = {
    "negative size": ({"dram": {"size": "-1Gi"}}, helm_python.HelmValuesError,
                      r"/dram/size.*does not match pattern"),
    "L4 without an address": ({"remote": {"enabled": True}}, helm_python.HelmRenderError,
                              r"--set remote\.address="),
    "L3 without a volume": ({"nvme": {"enabled": True, "volume": {"type": ""}}},
                            helm_python.HelmRenderError,
                            r"--set nvme\.volume\.type=hostPath"),
    "L2 over the memory limit": ({"dram": {"size": "16Gi"}}, helm_python.HelmRenderError,
                                 r"--set dram\.size=7680Mi"),
    "claim per daemon in a DaemonSet": ({"nvme": {"enabled": True,
                                                  "volume": {"type": "persistentVolumeClaim"}}},
                                        helm_python.HelmRenderError, r"--set kind=StatefulSet"),
    "unknown policy": ({"nvme": {"placement": "random"}}, helm_python.HelmValuesError,
                       r"/nvme/placement"),
    "GDS on the CPU image": ({"image": {"variant": "cpu"}, "nvme": {"gds": {"enabled": True}}},
                             helm_python.HelmRenderError, r"--set image\.variant=cuda"),
    "drain notice past the grace": ({"server": {"drainNoticeSeconds": 9}},
                                    helm_python.HelmRenderError,
                                    r"--set server\.drainNoticeSeconds=1"),
    "mtls without TLS": ({"auth": {"mode": "mtls", "tenants": [TEAM_B]}},
                         helm_python.HelmRenderError, r"--set tls\.enabled=true"),
    "TLS without a certificate": ({"tls": {"enabled": True}}, helm_python.HelmRenderError,
                                  r"--set tls\.secretName="),
    "hostIPC with auth on": ({"dram": {"hostIPC": True}}, helm_python.HelmRenderError,
                             r"--set dram\.hostIPC=false"),
    "tenants beside an existing Secret": ({"auth": {"existingSecret": "t", "tenants": [TEAM_A]}},
                                          helm_python.HelmRenderError, r"Keep one"),
    "mtls with nobody to name": ({"auth": {"mode": "mtls"},
                                  "tls": {"enabled": True, "secretName": "kv-tls"}},
                                 helm_python.HelmRenderError, r"auth\.existingSecret="),
    "a second tenant default": ({"auth": {"tenants": [{**TEAM_A, "name": "default"}]}},
                                helm_python.HelmRenderError, r"Rename yours"),
    "rotation hashes without tenant default": (
        {"auth": {"existingSecret": "t", "extraTokenHashes": [NEXT_HASH]}},
        helm_python.HelmRenderError, r"--set auth\.extraTokenHashes=null"),
    "unknown mode": ({"auth": {"mode": "oidc"}}, helm_python.HelmValuesError, r"/auth/mode"),
    # kvstore/units.py refuses "8gb" (gigabytes or gibibytes?); the schema says so first.
    "an ambiguous decimal quota": ({"auth": {"tenants": [{**TEAM_A, "quota": {"dram": "8gb"}}]}},
                                   helm_python.HelmValuesError, r"/auth/tenants/0/quota/dram"),
    "a size that is neither spelling as a quota": (
        {"auth": {"tenants": [{**TEAM_A, "quota": {"dram": "8 gigs"}}]}},
        helm_python.HelmValuesError, r"/auth/tenants/0/quota/dram"),
    "a token in clear as its hash": (
        {"auth": {"tenants": [{**TEAM_A, "tokens_sha256": ["s3cret"]}]}},
        helm_python.HelmValuesError, r"/auth/tenants/0/tokens_sha256"),
    "a misspelt tenant field": ({"auth": {"tenants": [{**TEAM_A, "namespace": ["a/"]}]}},
                                helm_python.HelmValuesError, r"namespace"),
    "an unknown role": ({"auth": {"tenants": [{**TEAM_A, "role": "root"}]}},
                        helm_python.HelmValuesError, r"/auth/tenants/0/role"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_bad_values_are_refused_with_the_fix(chart: Any, case: str) -> None:
    values, error, message = BAD_VALUES[case]
    with pytest.raises(error, match=message):
        chart.render(ci_values(values), name=RELEASE, namespace=NAMESPACE)


def test_a_typo_in_extra_config_fails_the_render_naming_it(chart: Any) -> None:
    """extraConfig reaches the daemon as is, and the daemon refuses an unknown key at start:
    in a cluster that is a crash-looping pod. The chart's schema lists the daemon's sections
    and keys, so `helm install` refuses the typo first, naming it."""
    with pytest.raises(helm_python.HelmValuesError,
                       match=r"/extraConfig/movers.*'high_watermrk' not allowed"):
        render(chart, {"extraConfig": {"movers": {"high_watermrk": 0.8}}})
    with pytest.raises(helm_python.HelmValuesError, match=r"/extraConfig.*'mover' not allowed"):
        render(chart, {"extraConfig": {"mover": {"high_watermark": 0.8}}})
    ok = render(chart, {"extraConfig": {"movers": {"high_watermark": 0.8}, "log_level": "DEBUG"}})
    assert daemon_config(ok).movers.high_watermark == 0.8
    assert daemon_config(ok).log_level == "INFO"  # server.logLevel is the chart's, and wins


def test_extra_config_schema_is_the_daemons_config() -> None:
    """The schema's list is the daemon's own (kvstore/daemon/config/schema.py), section by
    section and key by key, so a key the daemon gains or loses cannot drift from the chart."""
    import dataclasses
    import json

    from kvstore.daemon.config.schema import SECTIONS, Config
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())["properties"]
    extra = schema["extraConfig"]
    assert extra["additionalProperties"] is False
    top = {f.name for f in dataclasses.fields(Config)}
    assert set(extra["properties"]) == top
    for section, cls in SECTIONS.items():
        listed = extra["properties"][section]
        assert listed["additionalProperties"] is False, section
        assert set(listed["properties"]) == {f.name for f in dataclasses.fields(cls)}, section


# --- issue 33: defaults that fit a Kubernetes cluster -----------------------------------


def test_no_gpu_is_requested_unless_l1_is_asked_for(chart: Any) -> None:
    """Finding 3: L1 on by default took one GPU per node from the engines."""
    plain = container(workload(render(chart, {})))
    assert "nvidia.com/gpu" not in plain["resources"]["limits"]
    l1 = render(chart, L1_ON)
    assert container(workload(l1))["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert daemon_config(l1).hbm.mode == "on"
    two = render(chart, {"hbm": {"enabled": True, "gpus": 2}})
    assert container(workload(two))["resources"]["limits"]["nvidia.com/gpu"] == 2
    # What it costs is said where the switch is.
    values = (CHART_DIR / "values.yaml").read_text()
    assert "it costs one GPU per node" in values and "taken from the engines" in values
    assert "one GPU per node, taken from the engines" in _guide()


def test_engines_reach_the_daemon_of_their_own_node(chart: Any) -> None:
    """Finding 3: Attach and the Unix socket need the engine's own node's daemon, so the
    DaemonSet's Service routes node-locally; a StatefulSet's replicas are not per node."""
    r = render(chart, {})
    assert r.one("Service", FULLNAME)["spec"]["internalTrafficPolicy"] == "Local"
    assert "port-forward pod/<pod> 50051" in r.notes
    assert "--set service.internalTrafficPolicy=Local" not in r.notes
    sts = render(chart, {"kind": "StatefulSet"})
    assert sts.one("Service", FULLNAME)["spec"]["internalTrafficPolicy"] == "Cluster"
    assert "Attach must reach the daemon on the engine's own node" in sts.notes
    forced = render(chart, {"service": {"internalTrafficPolicy": "Cluster"}})
    assert forced.one("Service", FULLNAME)["spec"]["internalTrafficPolicy"] == "Cluster"
    # The helm test pod goes where the daemons are, so a Local Service still has one for it.
    test_pod = r.one("Pod")
    assert test_pod["spec"]["nodeSelector"] == pod_spec(workload(r))["nodeSelector"]


def test_engines_get_a_client_token_beside_the_admin_one(chart: Any) -> None:
    """Finding 3: the only generated tenant was an admin, and NOTES told engines to mount it.
    Now tenant `engine` (role client, every namespace) has its own token, and the daemon's
    own parser takes the file: the admin owns no namespace, spanning them by its role."""
    from kvstore.core.tenants import parse_tenants
    r = render(chart, {})
    admin_token = secret_data(r.one("Secret", f"{FULLNAME}-token"), "token")
    engine_token = secret_data(r.one("Secret", f"{FULLNAME}-engine-token"), "token")
    assert len(engine_token) >= 43 and engine_token != admin_token
    tenants = parse_tenants({"tenants": tenants_of(r)})
    assert tenants.names() == ["default", "engine"]
    engine = tenants.by_token(engine_token)
    admin = tenants.by_token(admin_token)
    assert engine is not None and engine.name == "engine" and not engine.admin
    assert engine.owns("vllm/llama/tp0")  # the connector's namespace without a prefix
    assert admin is not None and admin.admin and admin.namespaces == ()
    assert [t.name for t in tenants.holders()] == ["engine"]  # the admin holds no arena
    # NOTES sends engines to the engine token; the admin's is named for kvstore-admin only.
    assert f"secret: {{secretName: {FULLNAME}-engine-token}}" in r.notes
    assert f"secret: {{secretName: {FULLNAME}-token}}" not in r.notes
    # The daemon's own pod still drains with the admin token, never the engine's.
    assert volume(workload(r), "token")["secret"]["secretName"] == f"{FULLNAME}-token"
    # With quotas of its own, in either spelling.
    q = render(chart, {"auth": {"engine": {"quota": {"dram": "4Gi", "nvme": "16GiB"}}}})
    assert parse_tenants({"tenants": tenants_of(q)}).named("engine").quota == {
        "dram": 4 << 30, "nvme": 16 << 30}


def test_the_engine_tenant_beside_teams_of_their_own(chart: Any) -> None:
    """Beside auth.tenants, engine's "" would overlap their prefixes, which the daemon
    refuses: the chart refuses it first, naming both fixes; either fix renders."""
    with pytest.raises(helm_python.HelmRenderError) as info:
        render(chart, {"auth": {"tenants": [TEAM_A]}})
    message = str(info.value)
    assert 'Tenant engine owns "", which overlaps "team-a/" of tenant "team-a"' in message
    assert "--set auth.engine.enabled=false" in message
    own = render(chart, {"auth": {"tenants": [TEAM_A], "engine": {"namespaces": ["engine/"]}}})
    assert [t["name"] for t in tenants_of(own)] == ["default", "engine", "team-a"]
    off = render(chart, {"auth": {"tenants": [TEAM_A], "engine": {"enabled": False}}})
    assert [t["name"] for t in tenants_of(off)] == ["default", "team-a"]
    assert not [s for s in off.all("Secret") if s["metadata"]["name"].endswith("engine-token")]
    assert "their own tenant" in off.notes
    with pytest.raises(helm_python.HelmRenderError, match="Rename"):
        render(chart, {"auth": {"tenants": [{**TEAM_A, "name": "engine"}],
                                "engine": {"namespaces": ["engine/"]}}})
    mtls = render(chart, CASES["mtls_tls"])  # no token to generate: no engine tenant either
    assert [t["name"] for t in tenants_of(mtls)] == ["team-b"]


def test_l3_lives_only_where_it_is_put(chart: Any) -> None:
    """Finding 3: L3 defaulted to a 100 GiB file under /var/lib, usually the node's root disk.
    Now L3 is off until given a place, and a hostPath without a folder is refused."""
    r = render(chart, {})
    assert not daemon_config(r).nvme.enabled and volume(workload(r), "l3") is None
    assert "--set nvme.enabled=true --set nvme.volume.hostPath.path=" in r.notes
    on = render(chart, L3_ON)
    assert volume(workload(on), "l3")["hostPath"]["path"] == L3_FOLDER
    assert daemon_config(on).nvme.capacity_bytes == 32 << 30
    with pytest.raises(helm_python.HelmRenderError,
                       match=r"--set nvme\.volume\.hostPath\.path=/mnt/nvme/kvstore"):
        render(chart, {"nvme": {"enabled": True}})
    spilled = render(chart, {"nvme": {"enabled": True, "volume": {"type": "emptyDir"}}})
    assert "emptyDir" in volume(workload(spilled), "l3")


def test_sizes_take_either_spelling_in_values_and_quotas(chart: Any) -> None:
    """Finding 8: values said `8Gi`, quotas `8GiB`. Both spellings work in both places, and
    mean the same bytes (kvstore/units.py reads `8GiB`; Kubernetes reads `8Gi`)."""
    k8s = {"dram": {"size": "2Gi"}, "nvme": {"enabled": True, "size": "8Gi",
                                             "volume": {"type": "emptyDir",
                                                        "emptyDir": {"sizeLimit": "9Gi"}}},
           "server": {"maxObjectSize": "32Mi"}}
    daemon = {"dram": {"size": "2GiB"}, "nvme": {"enabled": True, "size": "8GiB",
                                                 "volume": {"type": "emptyDir",
                                                            "emptyDir": {"sizeLimit": "9GiB"}}},
              "server": {"maxObjectSize": "32MiB"}}
    a, b = render(chart, k8s), render(chart, daemon)
    assert daemon_config(a) == daemon_config(b)
    assert daemon_config(b).dram.capacity_bytes == 2 << 30
    assert volume(workload(b), "l3")["emptyDir"]["sizeLimit"] == "9Gi"  # Kubernetes' spelling
    assert volume(workload(a), "shm") == volume(workload(b), "shm")
    sts = render(chart, {"kind": "StatefulSet", "nvme": {
        "enabled": True, "volume": {"type": "persistentVolumeClaim",
                                    "persistentVolumeClaim": {"size": "40GiB"}}}})
    [claim] = workload(sts)["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "40Gi"
    from kvstore.core.tenants import parse_tenants
    tenant = {**TEAM_A, "quota": {"dram": "2Gi", "nvme": "20GiB", "pinned": 536870912}}
    q = render(chart, {"auth": {"tenants": [tenant], "engine": {"enabled": False}}})
    [_, written] = tenants_of(q)
    assert written["quota"] == {"dram": "2GiB", "nvme": "20GiB", "pinned": 536870912}
    assert parse_tenants({"tenants": [written]}).named("team-a").quota == {
        "dram": 2 << 30, "nvme": 20 << 30, "pinned": 512 << 20}


def test_readme_documents_deploy_guide() -> None:
    guide = (REPO / "docs" / "kubernetes.md").read_text()
    for topic in ("helm install", "hostIPC", "helm upgrade", "kvstore-admin", "NetworkPolicy"):
        assert topic in guide, topic
    assert yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["name"] == "kvstore"
    assert "(security.md)" in guide and "auth.existingSecret" in guide


def test_security_guide_covers_what_the_chart_relies_on() -> None:
    guide = (REPO / "docs" / "security.md").read_text()
    for topic in ("Threat model", "SCM_RIGHTS", '{"arenas": [',
                  '{"error": "...", "reason": "..."}', "Attach",
                  "printf %s \"$TOKEN\" | sha256sum", "kill -HUP", "openssl req", "URI:spiffe://",
                  "tokens_sha256", "identities", "namespaces", "quota", "PERMISSION_DENIED",
                  "UNAUTHENTICATED", "metrics port has no authentication", "auth.extraTokenHashes"):
        assert topic in guide, topic


# --- docs/kubernetes.md: its values, commands and manifests render as the chart reads them --


def _guide_block(lang: str, marker: str) -> str:
    """The text of the guide's one ```lang block that contains marker."""
    blocks = re.findall(rf"^```{lang}\n(.*?)^```", _guide(), re.M | re.S)
    [text] = [b for b in blocks if marker in b]
    return str(text)


def _set_values(command: str) -> dict[str, Any]:
    """The values a `helm install ... --set a.b=c,d=e` line sets, as Helm reads them."""
    import json
    import shlex

    words = shlex.split(command.replace("\\\n", " "), comments=True)
    values: dict[str, Any] = {}
    for flag, arg in zip(words, words[1:], strict=False):
        pairs = [arg] if flag == "--set-json" else arg.split(",") if flag == "--set" else []
        for pair in pairs:
            path, raw = pair.split("=", 1)
            value: Any = json.loads(raw) if flag == "--set-json" else (
                {"true": True, "false": False, "null": None}.get(raw, int(raw) if raw.isdigit()
                                                                 else raw))
            *parents, leaf = path.split(".")
            node = values
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = value
    return values


def test_guide_install_command_renders(chart: Any) -> None:
    install = _guide_block("console", "helm install kvstore")
    values = _set_values(install.split("\nkubectl")[0])
    assert values["nvme"]["enabled"] is True  # L3 is opt-in: the guide opts in, with a folder
    files = chart.render(values, name="kvstore", namespace="kvstore", is_install=True)
    objects = [d for p, text in files.items() if not p.endswith("NOTES.txt")
               for d in yaml.safe_load_all(text) if d]
    [ds] = [o for o in objects if o["kind"] == "DaemonSet"]
    assert volume(ds, "l3")["hostPath"]["path"] == "/mnt/nvme0/kvstore"
    assert "nvidia.com/gpu" not in container(ds)["resources"]["limits"]
    [svc] = [o for o in objects if o["kind"] == "Service"]
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    # The token the guide reads for engines is a Secret this install makes.
    secrets = {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"}
    assert re.search(r"get secret (\S+) ", install)[1] in secrets
    for obj in objects:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_guide_tenants_values_render(chart: Any) -> None:
    """The guide's values-tenants.yaml, with a real hash for its placeholder, renders into a
    tenants file the daemon's parser takes, its `8Gi` quotas read as the daemon's bytes."""
    from kvstore.core.tenants import parse_tenants
    text = _guide_block("yaml", "# values-tenants.yaml")
    digest = hashlib.sha256(b"team-a's token").hexdigest()
    values = yaml.safe_load(text.replace("<the hash>", digest))
    tenants = parse_tenants({"tenants": tenants_of(render(chart, values))})
    assert tenants.names() == ["default", "team-a"]
    assert tenants.named("team-a").quota == {"dram": 8 << 30, "nvme": 200 << 30,
                                             "pinned": 1 << 30}
    # Without its `engine` line the overlap is refused, as the guide says.
    del values["auth"]["engine"]
    with pytest.raises(helm_python.HelmRenderError, match="auth.engine.enabled=false"):
        render(chart, values)


def test_guide_engine_pod_is_valid_and_matches_the_chart(chart: Any) -> None:
    """The guide's engine Pod is a valid Pod that mounts what the chart makes: the engine
    token's Secret, the socket folder, the node-local Service; its namespace_prefix is one
    tenant engine owns."""
    import json

    from kvstore.core.tenants import parse_tenants
    pod = yaml.safe_load(_guide_block("yaml", "kind: Pod"))
    kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)
    files = chart.render(ci_values({}), name="kvstore", namespace=pod["metadata"]["namespace"],
                         is_install=True)
    objects = [d for p, text in files.items() if not p.endswith("NOTES.txt")
               for d in yaml.safe_load_all(text) if d]
    [svc] = [o for o in objects if o["kind"] == "Service"]
    [ctr] = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in ctr["env"]}
    assert env["KVSTORE_TARGET"] == \
        f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:50051"
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    secret_name = vols["kvstore-token"]["secret"]["secretName"]
    [engine_secret] = [o for o in objects if o["metadata"]["name"] == secret_name]
    mounted = {m["name"]: m["mountPath"] for m in ctr["volumeMounts"]}
    assert env["KVSTORE_TOKEN_FILE"] == mounted["kvstore-token"] + "/token"
    assert vols["kvstore-socket"]["hostPath"]["path"] == \
        yaml.safe_load((CHART_DIR / "values.yaml").read_text())["unixSocket"]["hostPath"]
    [tenants_secret] = [o for o in objects if o["metadata"]["name"] == "kvstore-tenants"]
    tenants = parse_tenants(yaml.safe_load(secret_data(tenants_secret, "tenants.yaml")))
    engine = tenants.by_token(secret_data(engine_secret, "token"))
    assert engine is not None and not engine.admin
    transfer = json.loads(next(a for a in ctr["args"] if "kv_connector" in a)
                          .split("=", 1)[1])
    prefix = transfer["kv_connector_extra_config"]["namespace_prefix"]
    assert engine.owns(f"{prefix}vllm/model")


def test_a_daemon_serves_the_engine_token_as_a_client_and_the_admin_token_as_admin(
        chart: Any, daemon_factory: Any, tmp_path: Path) -> None:
    """The generated tenants file, run by a real daemon: the engine token writes and reads
    the connector's namespace but is refused Drain (an admin verb); the admin token, owning
    no namespace, still reads daemon-wide stats by its role."""
    import os

    from kvstore.client import KVStoreClient, PermissionDenied
    r = render(chart, {})
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(secret_data(r.one("Secret", f"{FULLNAME}-tenants"), "tenants.yaml"))
    engine_token = secret_data(r.one("Secret", f"{FULLNAME}-engine-token"), "token")
    admin_token = secret_data(r.one("Secret", f"{FULLNAME}-token"), "token")
    d = daemon_factory("auth.mode=token", f"auth.tenants_file={tenants}", "hbm.mode=off",
                       "dram.capacity_bytes=32MiB", "nvme.enabled=false")
    key = os.urandom(32)
    with KVStoreClient(d.target, "vllm/model/tp0", token=engine_token) as engine:
        engine.put([key], [b"x" * 4096])
        assert engine.get([key]) == [b"x" * 4096]
        with pytest.raises(PermissionDenied):
            engine.drain()
    with KVStoreClient(d.target, "vllm/model/tp0", token=admin_token) as admin:
        assert admin.stats().tiers  # daemon-wide figures: an admin's


def test_the_data_port_is_configured_exposed_and_allowed_only_when_set(chart: Any) -> None:
    off = render(chart, {"networkPolicy": {"enabled": True}})
    assert daemon_config(off).server.data_port == -1
    assert [p["name"] for p in container(workload(off))["ports"]] == ["grpc", "metrics"]
    on = render(chart, {"server": {"dataPort": 50052}, "networkPolicy": {"enabled": True}})
    assert daemon_config(on).server.data_port == 50052
    assert {"name": "data", "containerPort": 50052, "protocol": "TCP"} in (
        container(workload(on))["ports"])
    service = on.one("Service", FULLNAME)["spec"]["ports"]
    assert {"name": "data", "port": 50052, "targetPort": "data", "protocol": "TCP"} in service
    [rule] = [r for r in on.one("NetworkPolicy")["spec"]["ingress"]
              if {"port": 50052, "protocol": "TCP"} in r["ports"]]
    assert {"port": 50051, "protocol": "TCP"} in rule["ports"]  # beside gRPC's, same peers
