"""The chart's monitoring and its default install, rendered offline: the Grafana dashboard
ConfigMap and the PrometheusRule are well formed, and every metric name their expressions
read is one a live kvstore-server (L2, L3 in a tmp folder, L4 on a real redis-server, the Unix
socket) exposes on /metrics after a put, a get and a lookup. Also the findings of a default
install that could not start: the placeholder image is refused with the build-and-push advice,
L3 is writable by the daemon's user in every value set, bad combinations are refused naming
the fix, and Chart.yaml's icon is a file the repository ships."""

from __future__ import annotations

import json
import os
import re
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import KVStoreClient
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon, RedisServer, start_daemon, start_redis
from tests.e2e.helm_render import (
    CASES,
    CHART_DIR,
    FULLNAME,
    L3_FOLDER,
    L3_ON,
    NAMESPACE,
    RELEASE,
    REPO,
    Rendered,
    ci_values,
    container,
    daemon_config,
    mount,
    pod_spec,
    render,
    volume,
    workload,
)

try:
    import helm_python
except ImportError as exc:
    pytest.skip(f"chart tests need helm-python-sdk ({exc})", allow_module_level=True)


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    loaded = helm_python.Chart.load(CHART_DIR)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def observed(chart: Any) -> Rendered:
    return render(chart, CASES["observability"])


def refusal(chart: Any, values: dict[str, Any]) -> str:
    with pytest.raises(helm_python.HelmRenderError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return str(info.value)


# --- the findings: a default install that starts -----------------------------------------


def test_the_default_values_refuse_the_placeholder_image_with_the_advice(chart: Any) -> None:
    message = refusal(chart, {})  # the chart's defaults alone, as a bare `helm install`
    assert "kvstore: image.repository" in message and "ghcr.io/example/kvstore" in message
    assert "docker build -f docker/Dockerfile -t registry.example.com/ml/kvstore:0.1.0-cuda ." \
        in message
    assert "docker push registry.example.com/ml/kvstore:0.1.0-cuda" in message
    assert "--set image.registry=registry.example.com --set image.repository=ml/kvstore" in message
    # The CPU image is built with its own flag; the placeholder is refused however it is split.
    cpu = refusal(chart, {"image": {"variant": "cpu"}, "hbm": {"enabled": False}})
    assert "--build-arg VARIANT=cpu -t registry.example.com/ml/kvstore:0.1.0-cpu" in cpu
    assert "placeholder" in refusal(
        chart, {"image": {"registry": "", "repository": "ghcr.io/example/kvstore"}})


def test_an_image_of_your_own_installs(chart: Any) -> None:
    r = render(chart, {"image": {"registry": "ghcr.io", "repository": "acme/kvstore",
                                 "tag": "0.1.0-cuda-1"}})
    assert container(workload(r))["image"] == "ghcr.io/acme/kvstore:0.1.0-cuda-1"
    ci = yaml.safe_load((CHART_DIR / "ci" / "test-values.yaml").read_text())
    assert container(workload(render(chart, {})))["image"] == \
        f"{ci['image']['registry']}/{ci['image']['repository']}:0.1.0-cuda"


def _daemon_ids(wl: dict[str, Any]) -> tuple[int, int]:
    """uid, gid the daemon container runs as (its securityContext over the pod's)."""
    pod, ctr = pod_spec(wl)["securityContext"], container(wl)["securityContext"]
    return (ctr.get("runAsUser", pod.get("runAsUser")),
            ctr.get("runAsGroup", pod.get("runAsGroup")))


def l3_write_access(r: Rendered) -> str:
    """How the daemon's user gets to write L3 in this render (or AssertionError): "chown"
    (an init container gives the hostPath folder to it), "fsGroup" (a claim the kubelet
    gives to the pod's fsGroup), "emptyDir" (world-writable, and fsGroup's) or "prepared"
    (a hostPath of type Directory the operator made: the kubelet does not create it)."""
    wl = workload(r)
    uid, gid = _daemon_ids(wl)
    daemon_mount = mount(container(wl), "l3")
    claims = [c["metadata"]["name"] for c in wl["spec"].get("volumeClaimTemplates", [])]
    if "l3" in claims:
        assert pod_spec(wl)["securityContext"].get("fsGroup") is not None
        return "fsGroup"
    l3 = volume(wl, "l3")
    assert l3 is not None and daemon_mount is not None
    if "emptyDir" in l3:
        return "emptyDir"
    assert "hostPath" in l3, l3
    chowns = [c for c in pod_spec(wl).get("initContainers", []) if mount(c, "l3")]
    if not chowns:
        assert l3["hostPath"]["type"] == "Directory", "a folder the kubelet makes is root's"
        return "prepared"
    [init] = chowns
    init_mount = mount(init, "l3")
    assert init_mount is not None
    assert init_mount.get("subPathExpr") == daemon_mount.get("subPathExpr")  # the same folder
    assert init["command"] == ["chown", "-R", f"{uid}:{gid}", init_mount["mountPath"]]
    sc = init["securityContext"]
    assert sc["runAsUser"] == 0 and sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    return "chown"


EXPECTED_ACCESS = {"cpu": "emptyDir", "statefulset": "fsGroup", "prepared_l3_folder": "prepared",
                   "gpu_gds": "chown", "hostpath_statefulset_cpu": "chown"}


@pytest.mark.parametrize("case", CASES)
def test_l3_is_writable_by_the_daemon_in_every_value_set(chart: Any, case: str) -> None:
    """Where a value set puts L3, the daemon can write it; the others leave L3 off (its
    default: the chart never guesses a disk for a preallocated file)."""
    r = render(chart, CASES[case])
    if case not in EXPECTED_ACCESS:
        assert not daemon_config(r).nvme.enabled and volume(workload(r), "l3") is None
        return
    assert daemon_config(r).nvme.enabled
    assert l3_write_access(r) == EXPECTED_ACCESS[case]


def test_the_chown_follows_the_daemon_user(chart: Any) -> None:
    r = render(chart, {**L3_ON,
                       "containerSecurityContext": {"runAsUser": 20002, "runAsGroup": 20003}})
    assert l3_write_access(r) == "chown"
    socket_dir = pod_spec(workload(r))["initContainers"][0]
    assert socket_dir["command"] == ["chown", "20002:20003", "/run/kvstore"]
    assert "gives the folder to 20002:20003" in r.notes


def test_notes_say_how_l3_is_stored(chart: Any) -> None:
    assert "init container volume-permissions gives the folder to 10001:10001" in \
        render(chart, L3_ON).notes
    assert "L3 is off (nvme.enabled=false)" in render(chart, {}).notes
    assert "must exist on every node, owned by 10001:10001" in \
        render(chart, CASES["prepared_l3_folder"]).notes
    assert "is an emptyDir: it is lost with the pod" in render(chart, CASES["cpu"]).notes
    assert "is a claim per replica" in render(chart, CASES["statefulset"]).notes


REFUSED: dict[str, tuple[dict[str, Any], list[str]]] = {
    "a root-owned L3 folder the kubelet creates": (
        {**L3_ON, "volumePermissions": {"enabled": False}},
        ["kvstore: volumePermissions.enabled", "--set volumePermissions.enabled=true",
         f"install -d -o 10001 -g 10001 {L3_FOLDER}",
         "--set nvme.volume.hostPath.type=Directory"]),
    "an L3 claim without fsGroup": (
        {"kind": "StatefulSet", "nvme": {"enabled": True,
                                          "volume": {"type": "persistentVolumeClaim"}},
         "podSecurityContext": {"fsGroup": None}},
        ["kvstore: podSecurityContext.fsGroup", "--set podSecurityContext.fsGroup=10001"]),
    "a dashboard without metrics": (
        {"metrics": {"enabled": False}, "grafana": {"dashboard": {"enabled": True}}},
        ["kvstore: metrics.enabled", "--set metrics.enabled=true"]),
    "alerts without metrics": (
        {"metrics": {"enabled": False}, "prometheusRule": {"enabled": True}},
        ["--set metrics.enabled=true", "--set prometheusRule.enabled=false"]),
}


@pytest.mark.parametrize("case", REFUSED)
def test_combinations_that_cannot_work_are_refused_naming_the_fix(chart: Any, case: str) -> None:
    values, fixes = REFUSED[case]
    message = refusal(chart, ci_values(values))
    assert "image.repository" not in message  # the CI values name an image: only this refusal
    for fix in fixes:
        assert fix in message, fix


def test_the_icon_is_a_file_the_repository_ships() -> None:
    meta = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    icon, home = urlparse(meta["icon"]), urlparse(meta["home"])
    assert (icon.scheme, icon.netloc, home.netloc) == ("https", "raw.githubusercontent.com",
                                                       "github.com")
    owner, repo, _ref, *path = icon.path.strip("/").split("/")
    assert [owner, repo] == home.path.strip("/").split("/")  # the repository at `home`
    shipped = REPO.joinpath(*path)
    assert shipped.is_file() and shipped.is_relative_to(CHART_DIR), shipped
    assert ET.parse(shipped).getroot().tag == "{http://www.w3.org/2000/svg}svg"


# --- the dashboard and the rules, rendered ------------------------------------------------

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_NAMES = re.compile(r"(?<![\w:$])(kvstore_[\w:]*)(?![\w:])(?!\s*\()")


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads: kvstore_* identifiers that are not inside a
    string, a label matcher or a grouping clause, and are not called as functions."""
    bare = _GROUPING.sub(" ", _MATCHERS.sub(" ", _STRINGS.sub('""', expr)))
    return set(_NAMES.findall(bare))


def balanced(expr: str) -> bool:
    stack: list[str] = []
    for ch in _STRINGS.sub('""', expr):
        if ch in "([{":
            stack.append({"(": ")", "[": "]", "{": "}"}[ch])
        elif ch in ")]}" and (not stack or stack.pop() != ch):
            return False
    return not stack


def test_metric_names_are_read_from_promql() -> None:
    expr = ('sum by (tier, kvstore_label) (rate(kvstore_a_total{tier="kvstore_not_one",'
            'instance=~"$instance"}[5m])) / on(kvstore_x) group_left() kvstore_b'
            ' and kvstore_fn(kvstore_c:ratio) > 0 and label_values(kvstore_d, tenant)')
    assert metric_names(expr) == {"kvstore_a_total", "kvstore_b", "kvstore_c:ratio", "kvstore_d"}
    assert balanced(expr) and not balanced("rate(kvstore_a[5m)") and not balanced("sum(a))")


def dashboard_of(r: Rendered) -> dict[str, Any]:
    cm = r.one("ConfigMap", f"{FULLNAME}-dashboard")
    return dict(json.loads(cm["data"]["kvstore.json"]))


def dashboard_exprs(board: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    return exprs + [v["query"]["query"] for v in board["templating"]["list"]
                    if v["type"] == "query"]


def rule_exprs(r: Rendered) -> list[str]:
    rule = r.one("PrometheusRule")
    return [str(x["expr"]) for g in rule["spec"]["groups"] for x in g["rules"]]


def test_the_dashboard_configmap_is_a_valid_grafana_dashboard(observed: Rendered) -> None:
    cm = observed.one("ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "kvstore"}
    board = dashboard_of(observed)
    assert board == json.loads((CHART_DIR / "dashboards" / "kvstore.json").read_text())
    assert board["uid"] and board["title"] == "kvstore" and 36 <= board["schemaVersion"] <= 41
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    # "All" is a regex that also matches tenant "" (every Lookup with auth off).
    assert variables["tenant"]["allValue"] == variables["instance"]["allValue"] == ".*"
    ids: set[int] = set()
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        assert panel["id"] not in ids
        ids.add(panel["id"])
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24 and min(pos.values()) >= 0 and pos["h"] >= 1, panel
        taken = {(pos["x"] + i, pos["y"] + j) for i in range(pos["w"]) for j in range(pos["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        cells |= taken
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["refId"] and balanced(target["expr"]), target
            assert 'instance=~"$instance"' in target["expr"], target["expr"]
            if "tenant" in target["expr"]:
                assert 'tenant=~"$tenant"' in target["expr"], target["expr"]


def test_the_dashboard_shows_what_operators_need(observed: Rendered) -> None:
    used = set().union(*map(metric_names, dashboard_exprs(dashboard_of(observed))))
    needed = {
        "kvstore_tier_capacity_bytes", "kvstore_tier_used_bytes", "kvstore_tier_objects",
        "kvstore_tier_hits_total", "kvstore_tier_misses_total", "kvstore_prefix_hit_tokens_total",
        "kvstore_lookup_tokens_total", "kvstore_prefix_hit_blocks_total",
        "kvstore_lookup_blocks_total", "kvstore_tier_bytes_in_total",
        "kvstore_tier_bytes_out_total", "kvstore_tier_promotions_total",
        "kvstore_tier_demotions_total", "kvstore_tier_evictions_total", "kvstore_tier_available",
        "kvstore_tier_queue_depth", "kvstore_l4_queue_dropped_blocks_total",
        "kvstore_tier_checksum_failures_total", "kvstore_tier_io_errors_total",
        "kvstore_rpc_latency_seconds_bucket", "kvstore_rpc_latency_seconds_count",
        "kvstore_leases", "kvstore_reservations", "kvstore_pins", "kvstore_local_sessions",
        "kvstore_tenant_used_bytes", "kvstore_serving",
    }
    assert needed <= used, sorted(needed - used)


def test_the_dashboard_goes_where_the_sidecar_looks(chart: Any) -> None:
    r = render(chart, {"grafana": {"dashboard": {
        "enabled": True, "namespace": "monitoring", "label": "dashboards.example/grafana",
        "labelValue": "kvstore"}}})
    cm = r.one("ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["dashboards.example/grafana"] == "kvstore"
    assert "grafana_dashboard" not in cm["metadata"]["labels"]
    assert "ConfigMap rel-kvstore-dashboard in namespace\n   monitoring" in r.notes
    assert not render(chart, {}).all("PrometheusRule")
    assert [c["metadata"]["name"] for c in render(chart, {}).all("ConfigMap")] == [FULLNAME]


ALERTS = {"KVStoreRemoteDown", "KVStoreChecksumFailures", "KVStoreIOErrors", "KVStoreNotServing",
          "KVStoreDramFullEvicting", "KVStoreRemoteQueueDropping", "KVStoreStatsErrors"}
_DURATION = re.compile(r"^(0|([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?"
                       r"([0-9]+ms)?)$")


def test_the_prometheus_rule_is_well_formed(observed: Rendered) -> None:
    rule = observed.one("PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE
    assert rule["metadata"]["labels"]["release"] == "prom"  # prometheusRule.additionalLabels
    assert rule["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    [group] = rule["spec"]["groups"]
    assert group["name"] and {r["alert"] for r in group["rules"]} == ALERTS
    assert len(group["rules"]) == len(ALERTS)
    selector = f'job="{FULLNAME}",namespace="{NAMESPACE}"'  # the ServiceMonitor's targets
    for alert in group["rules"]:
        expr = alert["expr"]
        assert balanced(expr) and metric_names(expr), alert["alert"]
        for name in metric_names(expr):  # every series is this release's
            assert re.search(rf"{name}\{{[^}}]*{re.escape(selector)}\}}", expr), (name, expr)
        assert _DURATION.match(alert["for"]) and alert["labels"]["severity"], alert
        notes = alert["annotations"]
        assert notes["summary"] and "What to do:" in notes["description"], alert["alert"]
    rules = {r["alert"]: r for r in group["rules"]}
    assert "> 0.9" in rules["KVStoreDramFullEvicting"]["expr"]  # the thresholds of the values
    assert "> 250" in rules["KVStoreDramFullEvicting"]["expr"]
    down = rules["KVStoreRemoteDown"]["expr"]
    assert re.search(r'kvstore_tier_available\{tier="remote"[^}]*\} == 0', down)
    assert re.search(r'kvstore_tier_enabled\{tier="remote"[^}]*\} == 1', down)
    assert "kvstore_serving{" in rules["KVStoreNotServing"]["expr"]
    assert "PrometheusRule rel-kvstore in namespace kv" in observed.notes


def test_the_rules_take_a_selector_of_your_own(chart: Any) -> None:
    r = render(chart, {"prometheusRule": {"enabled": True, "selector": 'cluster="a"',
                                          "rateWindow": "10m"}})
    for expr in rule_exprs(r):
        assert 'cluster="a"' in expr and "job=" not in expr, expr
    assert "[10m]" in " ".join(rule_exprs(r))


# --- every name the dashboard and the rules read, on a live daemon's /metrics -------------


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer) -> Iterator[Daemon]:
    """A daemon with L2, L3 (in a tmp folder), L4 on a real Redis and the Unix socket."""
    workdir = tmp_path_factory.mktemp("observed")
    d = start_daemon(workdir, "hbm.mode=off", "dram.capacity_bytes=16MiB",
                     "dram.page_size_bytes=64KiB", "nvme.capacity_bytes=16MiB",
                     "nvme.page_size_bytes=64KiB", f"remote.url={redis_server.url}",
                     f"server.unix_socket={workdir / 'kv.sock'}")
    yield d
    assert d.stop() == 0, d.log()


def exposition(daemon: Daemon) -> dict[str, list[dict[str, str]]]:
    """After a put, a get and a lookup: every name /metrics exposes (families, their samples,
    and the sample names their type implies), with the label sets of its samples."""
    keys = [os.urandom(32) for _ in range(4)]
    with KVStoreClient(daemon.target, "observed", unix_socket=str(
            Path(daemon.log_path).parent / "kv.sock")) as kv:
        assert kv.put(keys, [os.urandom(70_000) for _ in keys]).stored == 4
        assert kv.get([*keys, os.urandom(32)])[-1] is None
    with grpc.insecure_channel(daemon.target) as channel:
        found = rpc.KVStoreStub(channel).Lookup(pb.LookupRequest(
            namespace="observed", keys=[*keys, os.urandom(32)], block_tokens=16), timeout=10)
    assert found.prefix_length == 4
    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    implied = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
               "summary": ("_sum", "_count")}
    names: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for name in (family.name, *(family.name + s for s in implied.get(family.type, ()))):
            names.setdefault(name, [])
        for sample in family.samples:
            names.setdefault(sample.name, []).append(sample.labels)
    return names


def test_every_metric_the_dashboard_and_the_rules_read_is_exposed(
        observed: Rendered, live: Daemon) -> None:
    exprs = dashboard_exprs(dashboard_of(observed)) + rule_exprs(observed)
    used = set().union(*map(metric_names, exprs))
    assert len(used) >= 30, sorted(used)
    exposed = exposition(live)
    missing = sorted(used - exposed.keys())
    assert not missing, f"not on a live daemon's /metrics: {missing}"
    # The tiers the expressions name are the tiers the daemon labels its series with.
    for expr in exprs:
        for name, matchers in re.findall(r"(kvstore_[\w:]*)\{([^{}]*)\}", expr):
            for op, value in re.findall(r'\btier\s*(=~|=)\s*"([^"]*)"', matchers):
                for tier in value.split("|") if op == "=~" else [value]:
                    assert any(s.get("tier") == tier for s in exposed[name]), (name, tier)


def test_the_guides_say_how_to_build_the_image_and_what_the_chart_watches(
        observed: Rendered) -> None:
    guide = (REPO / "docs" / "kubernetes.md").read_text()
    readme = (REPO / "README.md").read_text()
    for text in (guide, readme, (CHART_DIR / "README.md").read_text()):
        assert "docker build -f docker/Dockerfile" in text and "docker push" in text
        assert "--set image.registry=" in text and "--set image.repository=" in text
    assert "## 1. Build and push the image" in guide  # the section the refusal names
    assert "volume-permissions" in guide and "fsGroup" in guide and "emptyDir" in guide
    for alert in ALERTS:
        assert f"`{alert}`" in guide, alert
    assert "grafana_dashboard" in guide and "helm/kvstore/ci/test-values.yaml" in guide
