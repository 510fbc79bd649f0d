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

from kvstore.daemon.config import ConfigError
from kvstore.daemon.l3room import Space, capacity_problem
from tests.e2e.helm_render import (
    CASES,
    CHART_DIR,
    FULLNAME,
    KUBE_VERSION,
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
    assert ctr["image"] == "localhost:5000/kvstore:0.1.0-cuda"  # ci/test-values.yaml's
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
    assert not {"hostIPC", "hostNetwork"} & spec.keys()
    # Auth is on by default: one init container readies the Unix socket's folder, the other
    # gives the L3 folder (which the kubelet creates as root) to the daemon.
    assert [c["name"] for c in spec["initContainers"]] == ["socket-dir", "volume-permissions"]


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
        {f"{FULLNAME}-token", f"{FULLNAME}-tenants"}  # auth's own, none for Redis
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
    assert tenants_of(r) == [{"name": "default", "role": "admin", "namespaces": [""],
                            "tokens_sha256": [hashlib.sha256(token.encode()).hexdigest()]}]
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
    assert f"get secret {FULLNAME}-token -o jsonpath='{{.data.token}}' | base64 -d" in notes
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
    assert [c["name"] for c in pod_spec(wl)["initContainers"]] == ["volume-permissions"]
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
    default, *rest = tenants_of(r)
    token = secret_data(r.one("Secret", f"{FULLNAME}-token"), "token")
    assert default["tokens_sha256"] == [hashlib.sha256(token.encode()).hexdigest(), NEXT_HASH]
    assert rest == [TEAM_A, TEAM_B]
    assert default["namespaces"] == []  # "" would overlap the tenants' own prefixes
    # The daemon takes the file as rendered: its own parser, its own rules.
    from kvstore.core.tenants import parse_tenants
    assert parse_tenants({"tenants": [default, *rest]}).names() == ["default", *(
        t["name"] for t in rest)]
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
    assert inits == ["socket-dir", "volume-permissions"]
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
        wl = workload(render(chart, {"auth": {"tenants": tenants}}))
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
    "a Kubernetes size as a quota": ({"auth": {"tenants": [{**TEAM_A, "quota": {"dram": "8Gi"}}]}},
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
    assert "(security.md)" in guide and "auth.existingSecret" in guide


def test_security_guide_covers_what_the_chart_relies_on() -> None:
    guide = (REPO / "docs" / "security.md").read_text()
    for topic in ("Threat model", "SCM_RIGHTS", '{"arenas": [',
                  '{"error": "...", "reason": "..."}', "Attach",
                  "printf %s \"$TOKEN\" | sha256sum", "kill -HUP", "openssl req", "URI:spiffe://",
                  "tokens_sha256", "identities", "namespaces", "quota", "PERMISSION_DENIED",
                  "UNAUTHENTICATED", "metrics port has no authentication", "auth.extraTokenHashes"):
        assert topic in guide, topic
