"""charts/rlkube rendered and linted with the Helm v4 SDK: defaults, the watch/leader election/peering/metrics
variants, values the chart must refuse, and agreement with the CRD generator and the `rlkube operator` command
line."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import tomllib
from pathlib import Path

import helm_python as helm
import pytest
import yaml
from support.helm_chart import (
    CHART,
    FRAMEWORK_NEEDS,
    NAMESPACE_OBSERVATION,
    NOT_NEEDED,
    OPERATOR_NEEDS,
    find,
    one,
    operator_container,
    render,
    rules_allow,
)

from rlkube.api.crd import crd_yaml
from rlkube.cli import build_parser
from rlkube.controller.process import admission

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]

NAMESPACED = {"watch": {"clusterWide": False, "namespaces": ["team-a", "team-b"]}}
PEERING = {"peering": {"enabled": True}, "leaderElection": {"enabled": False}}
STANDALONE = {"leaderElection": {"enabled": False}}
VARIANTS = {
    "default": {},
    "ha": {"replicas": 3},
    "standalone": STANDALONE,
    "namespaced": NAMESPACED,
    "namespaced-release-ns": {"watch": {"clusterWide": False}},
    "peering": PEERING,
    "namespaced-peering": {**NAMESPACED, **PEERING},
    "no-metrics": {"metrics": {"enabled": False}},
    "servicemonitor": {"metrics": {"serviceMonitor": {"enabled": True, "additionalLabels": {"release": "prom"}}}},
    "grafana-dashboard": {"metrics": {"grafanaDashboard": {"enabled": True}}},
    "existing-sa": {"serviceAccount": {"create": False, "name": "ops"}, "rbac": {"aggregateToDefaultRoles": False}},
}


def _operator_args(docs) -> list[str]:
    container = operator_container(docs)
    assert container["command"] == ["rlkube"]
    return container["args"]


# --- the CRD and chart metadata ---------------------------------------------------------------------------


def test_chart_crd_is_the_generated_crd():
    chart_crd = (CHART / "crds" / "rlkube.io_trainingjobs.yaml").read_text()
    assert chart_crd == (ROOT / "crds" / "rlkube.io_trainingjobs.yaml").read_text(), (
        "charts/rlkube/crds/ drifted from crds/: run `make crd`"
    )
    assert chart_crd == crd_yaml(), "the CRD drifted from rlkube.api: run `make crd`"


def test_chart_loads_with_its_crds_and_version():
    with helm.Chart.load(CHART) as chart:
        meta = chart.metadata
        crds = {c["filename"] for c in chart.crds}
        kinds = {d["spec"]["names"]["kind"] for c in chart.crds for d in yaml.safe_load_all(c["data"]) if d}
        assert chart.schema is not None, "values.schema.json is missing"
    assert meta["appVersion"] == VERSION, "Chart.yaml appVersion must equal pyproject's version"
    assert meta["apiVersion"] == "v2" and meta["name"] == "rlkube"
    assert {"rlkube/crds/rlkube.io_trainingjobs.yaml", "rlkube/crds/kopf.dev_peerings.yaml"} <= crds, crds
    assert kinds == {"TrainingJob", "ClusterKopfPeering", "KopfPeering"}


def test_kopf_peering_crds_match_what_kopf_looks_for():
    from kopf._cogs.structs import references  # kopf's own selectors of its peering resources

    docs = list(yaml.safe_load_all((CHART / "crds" / "kopf.dev_peerings.yaml").read_text()))
    served = {(d["spec"]["group"], d["spec"]["names"]["plural"], d["spec"]["scope"]) for d in docs}
    for selector, scope in ((references.CLUSTER_PEERINGS_K, "Cluster"), (references.NAMESPACED_PEERINGS_K, "Namespaced")):
        assert (selector.group, selector.any_name, scope) in served
        assert all(v["name"] == selector.version for d in docs for v in d["spec"]["versions"])


# --- lint -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_lint_is_clean(variant):
    report = helm.lint(CHART, VARIANTS[variant], strict=True, namespace="rlkube-system", kube_version="v1.20.2")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


def test_lint_reports_a_broken_template(tmp_path):
    # The lint above means something only if lint fails on a chart we break on purpose.
    broken = tmp_path / "rlkube"
    with helm.Chart.load(CHART) as chart:
        chart.save_dir(tmp_path)
    (broken / "templates" / "broken.yaml").write_text("kind: ConfigMap\nmetadata: {name: {{ .Values.nope.deeper }}}\n")
    report = helm.lint(broken, strict=True)
    assert report["errors"] or any(m["severity"] >= 3 for m in report["messages"]), report


# --- default render ---------------------------------------------------------------------------------------


def test_default_render_has_the_expected_objects():
    docs = render()
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == [
        ("ClusterRole", "rel-rlkube-operator"),
        ("ClusterRole", "rel-rlkube-trainingjob-editor"),
        ("ClusterRole", "rel-rlkube-trainingjob-viewer"),
        ("ClusterRoleBinding", "rel-rlkube-operator"),
        ("Deployment", "rel-rlkube"),
        ("Role", "rel-rlkube-leader-election"),
        ("RoleBinding", "rel-rlkube-leader-election"),
        ("Secret", "rel-rlkube-webhook"),
        ("Service", "rel-rlkube-metrics"),
        ("Service", "rel-rlkube-webhook"),
        ("ServiceAccount", "rel-rlkube"),
        ("ValidatingWebhookConfiguration", "rel-rlkube-webhook.rlkube-system"),
    ]
    for d in docs:
        if d["kind"] not in ("ClusterRole", "ClusterRoleBinding", "ValidatingWebhookConfiguration"):
            assert d["metadata"]["namespace"] == "rlkube-system", d["kind"]
        assert d["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_deployment_runs_the_operator_command_line():
    docs = render()
    args = _operator_args(docs)
    assert args == [
        "operator", "--all-namespaces", "--standalone", "--leader-elect", "--lease-name=rel-rlkube",
        "--lease-namespace=rlkube-system", "--lease-duration=15", "--lease-renew-deadline=10",
        "--lease-retry-period=2", "--metrics-port=8080", "--liveness=http://0.0.0.0:8081/healthz",
        "--webhook-port=9443", "--webhook-cert-dir=/etc/rlkube/webhook",
    ]
    # The arguments are the ones `rlkube operator` accepts.
    parsed = build_parser().parse_args(args)
    assert parsed.all_namespaces and parsed.standalone and parsed.namespace == []
    assert parsed.leader_elect and parsed.lease_name == "rel-rlkube" and parsed.lease_namespace == "rlkube-system"
    assert (parsed.lease_duration, parsed.lease_renew_deadline, parsed.lease_retry_period) == (15, 10, 2)
    assert parsed.metrics_port == 8080 and parsed.liveness == "http://0.0.0.0:8081/healthz"
    container = operator_container(docs)
    assert container["image"] == f"ghcr.io/rlkube/operator:{VERSION}"


def test_probes_and_ports_line_up():
    docs = render()
    container = operator_container(docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 8080, "healthz": 8081, "webhook": 9443}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    parsed = build_parser().parse_args(_operator_args(docs))
    assert parsed.liveness.endswith(f":{ports['healthz']}/healthz")
    assert parsed.metrics_port == ports["metrics"] and parsed.webhook_port == ports["webhook"]
    service = one(docs, "Service", "rel-rlkube-metrics")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_deployment_selector_and_service_account():
    docs = render()
    deploy = one(docs, "Deployment")
    assert deploy["spec"]["selector"]["matchLabels"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    sa = one(docs, "ServiceAccount")
    assert deploy["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    binding = one(docs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "rlkube-system"}]
    assert binding["roleRef"]["name"] == "rel-rlkube-operator"


def test_pod_is_locked_down():
    docs = render()
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001  # the images' uid
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = operator_container(docs)["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert {"name": "tmp", "mountPath": "/tmp"} in operator_container(docs)["volumeMounts"]


# --- RBAC -------------------------------------------------------------------------------------------------


def test_cluster_wide_rbac_grants_what_the_operator_needs_and_no_more():
    docs = render()
    rules = one(docs, "ClusterRole", "rel-rlkube-operator")["rules"]
    for need in OPERATOR_NEEDS + FRAMEWORK_NEEDS:
        assert rules_allow(rules, *need), f"missing {need}"
    for extra in NOT_NEEDED + NAMESPACE_OBSERVATION:
        assert not rules_allow(rules, *extra), f"grants {extra}"
    assert not rules_allow(rules, "kopf.dev", "clusterkopfpeerings", "patch")  # peering is off
    for rule in rules:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule


def test_namespaced_rbac_is_confined_to_the_watched_namespaces():
    docs = render(NAMESPACED)
    cluster_rules = one(docs, "ClusterRole", "rel-rlkube-operator")["rules"]
    for need in FRAMEWORK_NEEDS + NAMESPACE_OBSERVATION:
        assert rules_allow(cluster_rules, *need), f"missing cluster-wide {need}"
    for need in OPERATOR_NEEDS:
        assert not rules_allow(cluster_rules, *need), f"{need} granted cluster-wide in namespaced mode"
    for ns in ("team-a", "team-b"):
        rules = one(docs, "Role", namespace=ns)["rules"]
        for need in OPERATOR_NEEDS:
            assert rules_allow(rules, *need), f"missing {need} in {ns}"
        binding = one(docs, "RoleBinding", namespace=ns)
        assert binding["subjects"][0]["namespace"] == "rlkube-system"
    args = _operator_args(docs)
    parsed = build_parser().parse_args(args)
    assert parsed.namespace == ["team-a", "team-b"] and not parsed.all_namespaces


def test_namespaced_without_a_list_watches_the_release_namespace():
    docs = render({"watch": {"clusterWide": False}}, namespace="ml")
    assert [r["metadata"]["namespace"] for r in find(docs, "Role", "rel-rlkube-operator")] == ["ml"]
    assert build_parser().parse_args(_operator_args(docs)).namespace == ["ml"]


def test_aggregated_user_roles():
    docs = render()
    editor = one(docs, "ClusterRole", "rel-rlkube-trainingjob-editor")
    assert editor["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert rules_allow(editor["rules"], "rlkube.io", "trainingjobs", "create")
    assert not rules_allow(editor["rules"], "rlkube.io", "trainingjobs/status", "patch")
    viewer = one(docs, "ClusterRole", "rel-rlkube-trainingjob-viewer")
    assert viewer["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert not rules_allow(viewer["rules"], "rlkube.io", "trainingjobs", "create")
    assert not find(render({"rbac": {"aggregateToDefaultRoles": False}}), "ClusterRole", "rel-rlkube-trainingjob-viewer")


def test_existing_service_account_and_no_rbac():
    docs = render(VARIANTS["existing-sa"])
    assert not find(docs, "ServiceAccount")
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
    assert one(docs, "ClusterRoleBinding")["subjects"][0]["name"] == "ops"
    docs = render({"rbac": {"create": False, "aggregateToDefaultRoles": False}})
    assert not find(docs, "ClusterRole") and not find(docs, "ClusterRoleBinding") and not find(docs, "Role")


# --- peering ----------------------------------------------------------------------------------------------


def test_cluster_wide_peering():
    docs = render(PEERING)
    assert one(docs, "ClusterKopfPeering")["metadata"]["name"] == "rlkube"
    assert one(docs, "ClusterKopfPeering")["apiVersion"] == "kopf.dev/v1"
    rules = one(docs, "ClusterRole", "rel-rlkube-operator")["rules"]
    for verb in ("get", "list", "watch", "patch"):
        assert rules_allow(rules, "kopf.dev", "clusterkopfpeerings", verb)
    parsed = build_parser().parse_args(_operator_args(docs))
    assert parsed.peering == "rlkube" and not parsed.standalone
    deploy = one(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "RollingUpdate"


def test_namespaced_peering():
    docs = render({**NAMESPACED, **PEERING})
    assert sorted(p["metadata"]["namespace"] for p in find(docs, "KopfPeering")) == ["team-a", "team-b"]
    assert not find(docs, "ClusterKopfPeering")
    assert not rules_allow(one(docs, "ClusterRole", "rel-rlkube-operator")["rules"], "kopf.dev", "clusterkopfpeerings", "get")
    for ns in ("team-a", "team-b"):
        assert rules_allow(one(docs, "Role", namespace=ns)["rules"], "kopf.dev", "kopfpeerings", "patch")


# --- leader election -------------------------------------------------------------------------------------


def _lease_rules(docs, namespace="rlkube-system") -> list[dict]:
    return one(docs, "Role", "rel-rlkube-leader-election", namespace=namespace)["rules"]


def test_replicas_elect_a_leader_on_a_lease_in_the_release_namespace():
    docs = render({"replicas": 3, "leaderElection": {"leaseName": "ops-lease", "leaseDurationSeconds": 30,
                                                     "renewDeadlineSeconds": 20, "retryPeriodSeconds": 4}})
    deploy = one(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 3
    # A new pod starts as a standby and the old leader releases the Lease as it stops: rolling is safe.
    assert deploy["spec"]["strategy"] == {"type": "RollingUpdate"}
    parsed = build_parser().parse_args(_operator_args(docs))
    assert parsed.leader_elect and parsed.standalone and parsed.peering is None
    assert (parsed.lease_name, parsed.lease_namespace) == ("ops-lease", "rlkube-system")
    assert (parsed.lease_duration, parsed.lease_renew_deadline, parsed.lease_retry_period) == (30, 20, 4)
    from rlkube.controller.process.lease import Timing

    Timing(parsed.lease_duration, parsed.lease_renew_deadline, parsed.lease_retry_period)  # what the operator accepts
    # The identity comes from the pod name; the downward API provides it.
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in operator_container(docs)["env"]}
    assert env["POD_NAME"] == "metadata.name"


def test_lease_rbac_is_the_one_lease_and_only_in_the_release_namespace():
    for docs in (render(), render(NAMESPACED)):
        rules = _lease_rules(docs)
        named = [r for r in rules if r.get("resourceNames")]
        assert named == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["rel-rlkube"],
                          "verbs": ["get", "list", "watch", "update"]}]
        assert [r["verbs"] for r in rules if not r.get("resourceNames")] == [["create"]]
        binding = one(docs, "RoleBinding", "rel-rlkube-leader-election")
        assert binding["metadata"]["namespace"] == "rlkube-system"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rel-rlkube", "namespace": "rlkube-system"}]
        assert binding["roleRef"]["name"] == "rel-rlkube-leader-election"
        # No lease permissions anywhere else.
        for d in find(docs, "ClusterRole") + [r for r in find(docs, "Role") if r["metadata"]["name"] != "rel-rlkube-leader-election"]:
            assert not rules_allow(d["rules"], "coordination.k8s.io", "leases", "get"), d["metadata"]["name"]
    assert _lease_rules(render({"leaderElection": {"leaseName": "x"}}))[0]["resourceNames"] == ["x"]


def test_standalone_without_leader_election():
    docs = render(STANDALONE)
    # Two standalone operators must never overlap during a rollout.
    assert one(docs, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert not find(docs, "Role") and not find(docs, "RoleBinding")
    parsed = build_parser().parse_args(_operator_args(docs))
    assert parsed.standalone and not parsed.leader_elect


# --- metrics ----------------------------------------------------------------------------------------------


def test_metrics_disabled():
    docs = render({"metrics": {"enabled": False}})
    assert not find(docs, "Service", "rel-rlkube-metrics")
    assert build_parser().parse_args(_operator_args(docs)).metrics_port == 0
    assert [p["name"] for p in operator_container(docs)["ports"]] == ["healthz", "webhook"]


def test_service_monitor():
    assert not find(render(), "ServiceMonitor")
    docs = render(VARIANTS["servicemonitor"])
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True  # per-job series keep the job's namespace
    assert monitor["spec"]["selector"]["matchLabels"].items() <= one(docs, "Service", "rel-rlkube-metrics")["metadata"]["labels"].items()


def _exported_metric_names() -> set[str]:
    """Every series name the operator's registry can expose (per-job gauges included)."""
    from prometheus_client import REGISTRY

    import rlkube.controller.reconcile.metrics  # noqa: F401 (registers the operator's collectors)

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {f.name + suffix for f in REGISTRY.collect() for suffix in suffixes.get(f.type, ("",))}


def test_grafana_dashboard_configmap_carries_the_dashboard():
    assert not find(render(), "ConfigMap")
    assert not find(render({"metrics": {"enabled": False, "grafanaDashboard": {"enabled": True}}}), "ConfigMap")
    docs = render({"metrics": {"grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "rlkube"},
                                                    "namespace": "monitoring"}}})
    cm = one(docs, "ConfigMap", "rel-rlkube-dashboard", namespace="monitoring")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "rlkube"}
    shipped = json.loads((CHART / "dashboards" / "rlkube-trainingjobs.json").read_text())
    assert json.loads(cm["data"]["rlkube-trainingjobs.json"]) == shipped
    assert one(render(VARIANTS["grafana-dashboard"]), "ConfigMap")["metadata"]["namespace"] == "rlkube-system"


def test_grafana_dashboard_queries_only_metrics_the_operator_exports():
    dashboard = json.loads((CHART / "dashboards" / "rlkube-trainingjobs.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {name for e in exprs for name in re.findall(r"\b(rlkube_[a-z_]+)", e)}
    exported = _exported_metric_names()
    assert used - exported == set(), f"the dashboard queries metrics the operator does not export: {used - exported}"
    # What the issue asks users to plot and alert on, per job, is on the dashboard.
    per_job = {"status_phase", "step", "max_steps", "policy_lag", "reward_mean", "tokens_per_second",
               "seconds_since_last_trainer_event", "component_restarts", "teardown_stage_duration_seconds"}
    assert {f"rlkube_trainingjob_{n}" for n in per_job} <= used
    # every agent counter of status.agent and the evaluation's counts (rlkube.contract.counters) are plotted
    from rlkube.contract import counters
    from rlkube.controller.reconcile.jobmetrics import AGENT_PREFIX, EVAL_COUNTS
    shown = {f"rlkube_trainingjob_{AGENT_PREFIX}{n}" for n in counters.AGENT_STATUS}
    shown |= {f"rlkube_trainingjob_{n}" for n, _ in EVAL_COUNTS}
    assert shown - used == set(), f"not on the dashboard: {shown - used}"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)


def test_image_and_extra_args():
    docs = render({"image": {"repository": "registry.local/rlkube-operator", "tag": "dev"},
                   "operator": {"extraArgs": ["--namespace=extra"]}})
    assert operator_container(docs)["image"] == "registry.local/rlkube-operator:dev"
    assert _operator_args(docs)[-1] == "--namespace=extra"
    assert not any(a.startswith("--image-registry") for a in _operator_args(docs))


def test_one_image_registry_value_points_the_operator_and_its_role_images_at_the_registry():
    """`imageRegistry` (make push REGISTRY=...): the operator's image and the operator's default role images."""
    docs = render({"imageRegistry": "registry.example.com:5000/team/rlkube/"})
    assert operator_container(docs)["image"] == "registry.example.com:5000/team/rlkube/operator:0.1.0"
    assert "--image-registry=registry.example.com:5000/team/rlkube" in _operator_args(docs)


# --- values the chart refuses -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, error, message",
    [
        ({"replicas": 2, **STANDALONE}, helm.HelmRenderError, "standalone operators would all act"),
        ({"replicas": 3, **PEERING}, helm.HelmRenderError, "kopf pauses every operator of equal priority"),
        ({"peering": {"enabled": True}}, helm.HelmRenderError, "leaderElection.enabled and peering.enabled: choose one"),
        ({"leaderElection": {"leaseDurationSeconds": 10}}, helm.HelmRenderError, "must exceed renewDeadlineSeconds"),
        ({"leaderElection": {"retryPeriodSeconds": 9}}, helm.HelmRenderError, "1.2 x retryPeriodSeconds"),
        ({"leaderElection": {"leaseName": "Not_A_Name"}}, helm.HelmValuesError, "/leaderElection/leaseName"),
        ({"leaderElection": {"leaseDurationSeconds": "15s"}}, helm.HelmValuesError, "/leaderElection/leaseDurationSeconds"),
        ({"watch": {"namespaces": ["a"]}}, helm.HelmRenderError, "watch.clusterWide"),
        ({"replicas": "two"}, helm.HelmValuesError, "/replicas"),
        ({"metrics": {"port": 0}}, helm.HelmValuesError, "/metrics/port"),
        ({"metrics": {"prot": 8080}}, helm.HelmValuesError, "prot"),
        ({"watch": {"clusterWide": False, "namespaces": ["Not_A_Namespace"]}}, helm.HelmValuesError, "/watch/namespaces"),
        ({"image": {"pullPolicy": "Sometimes"}}, helm.HelmValuesError, "/image/pullPolicy"),
        ({"serviceAccount": {"create": False}}, helm.HelmRenderError, "serviceAccount.name"),
        ({"imageRegistry": "https://registry.example.com"}, helm.HelmValuesError, "/imageRegistry"),
    ],
    ids=["replicas-without-peering", "replicas-with-peering", "peering-and-leader-election", "lease-shorter-than-deadline",
         "deadline-vs-retry", "lease-name", "lease-duration-type", "namespaces-while-cluster-wide", "replicas-type",
         "port-range", "unknown-key", "namespace-name", "pull-policy", "sa-name", "image-registry-url"],
)
def test_bad_values_are_refused_naming_the_value(values, error, message):
    with pytest.raises(error) as err:
        render(values)
    assert message in str(err.value)


# --- the operator's real children -------------------------------------------------------------------------


EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_rbac_covers_every_child_the_operator_builds(path):
    # The children come from the operator's own pure builders, so a new kind of child without RBAC fails here.
    from rlkube.lifecycle.validation import parse_manifest
    from rlkube.controller.manifests.builders import JobRef, all_children

    doc = next(d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "TrainingJob")
    meta, spec = parse_manifest(doc)
    job = JobRef(namespace="team-a", name=meta["name"], uid="uid-1", spec=spec, raw_spec=doc["spec"])
    children = all_children(job, password="pw")
    assert children
    for docs, kind in ((render(), "ClusterRole"), (render(NAMESPACED), "Role")):
        rules = [r for d in find(docs, kind) if d["metadata"]["name"] == "rel-rlkube-operator" for r in d["rules"]]
        for child in children:
            group = child["apiVersion"].rpartition("/")[0]
            kind_lower = child["kind"].lower()
            resource = kind_lower[:-1] + "ies" if kind_lower.endswith("y") else kind_lower + "s"
            for verb in ("create", "delete", "get", "list", "watch"):
                assert rules_allow(rules, group, resource, verb), f"{kind}: cannot {verb} {child['kind']}"
            pod = child.get("spec", {}) if child["kind"] == "Pod" else {}
            for volume in pod.get("volumes", []):
                if "persistentVolumeClaim" in volume:
                    assert rules_allow(rules, "", "persistentvolumeclaims", "get")
            for container in pod.get("containers", []):
                for env in container.get("env", []):
                    if "secretKeyRef" in env.get("valueFrom", {}):
                        assert rules_allow(rules, "", "secrets", "get")
            assert child["metadata"]["ownerReferences"][0]["blockOwnerDeletion"] is True
            assert rules_allow(rules, "rlkube.io", "trainingjobs/finalizers", "update")


def test_packaged_chart_renders_the_same(tmp_path):
    # What a chart repository or OCI registry would serve: the .tgz carries templates, schema and both CRD files.
    archive = helm.package(CHART, destination=tmp_path)
    chart_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    assert Path(archive).name == f"rlkube-{chart_version}.tgz"
    with helm.Chart.load(archive) as packaged, helm.Chart.load(CHART) as source:
        # (the webhook's certificate is generated afresh by every render)
        assert _no_cert(packaged.render(values=NAMESPACED, name="rel", namespace="x")) == _no_cert(source.render(
            values=NAMESPACED, name="rel", namespace="x"))
        assert {c["filename"] for c in packaged.crds} == {c["filename"] for c in source.crds}
        assert packaged.schema == source.schema
    assert helm.digest(archive).startswith("sha256:")


def _no_cert(rendered: dict[str, str]) -> dict[str, str]:
    return {path: re.sub(r"(ca\.crt|tls\.crt|tls\.key|caBundle): \S+", r"\1: -", text) for path, text in rendered.items()}


# --- validating admission webhook ----------------------------------------------------------------------------


def _openssl(*args: str, stdin: str | None = None) -> str:
    out = subprocess.run(["openssl", *args], input=stdin, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_webhook_is_registered_served_and_trusted(tmp_path):
    """The generated certificate is for the webhook Service's DNS names and chains to the CA the API server is
    given; the operator serves on the port the Service targets, with the Secret mounted where it reads it."""
    docs = render()
    secret = one(docs, "Secret", "rel-rlkube-webhook")
    assert secret["type"] == "kubernetes.io/tls"
    pem = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    (tmp_path / "ca.pem").write_text(pem["ca.crt"])
    (tmp_path / "tls.pem").write_text(pem["tls.crt"])
    assert "tls.pem: OK" in _openssl("verify", "-CAfile", str(tmp_path / "ca.pem"), str(tmp_path / "tls.pem"))
    text = _openssl("x509", "-noout", "-text", stdin=pem["tls.crt"])
    for name in ("rel-rlkube-webhook", "rel-rlkube-webhook.rlkube-system", "rel-rlkube-webhook.rlkube-system.svc"):
        assert f"DNS:{name}" in text
    key = _openssl("pkey", "-pubout", stdin=pem["tls.key"])
    assert key == _openssl("x509", "-noout", "-pubkey", stdin=pem["tls.crt"])  # the key is the certificate's
    (hook,) = one(docs, "ValidatingWebhookConfiguration")["webhooks"]
    assert base64.b64decode(hook["clientConfig"]["caBundle"]).decode() == pem["ca.crt"]
    assert hook["clientConfig"]["service"] == {"name": "rel-rlkube-webhook", "namespace": "rlkube-system",
                                               "path": "/validate-trainingjob", "port": 443}
    assert hook["rules"] == [{"apiGroups": ["rlkube.io"], "apiVersions": ["v1alpha1"], "operations": ["CREATE"],
                              "resources": ["trainingjobs"], "scope": "Namespaced"}]
    assert (hook["failurePolicy"], hook["sideEffects"], hook["admissionReviewVersions"]) == ("Fail", "None", ["v1"])
    assert "namespaceSelector" not in hook  # cluster-wide: every namespace
    service = one(docs, "Service", "rel-rlkube-webhook")
    assert service["spec"]["ports"] == [{"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}]
    deploy = one(docs, "Deployment")
    assert service["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    parsed = build_parser().parse_args(_operator_args(docs))
    container = operator_container(docs)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "webhook-cert")
    assert mount == {"name": "webhook-cert", "mountPath": parsed.webhook_cert_dir, "readOnly": True}
    volume = next(v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == "webhook-cert")
    assert volume["secret"] == {"secretName": "rel-rlkube-webhook"}
    assert admission.PATH == hook["clientConfig"]["service"]["path"]
    assert {admission.CERT_FILE, admission.KEY_FILE} <= set(secret["data"])


def test_the_webhook_follows_the_watched_namespaces_and_can_be_turned_off():
    (hook,) = one(render(NAMESPACED), "ValidatingWebhookConfiguration")["webhooks"]
    assert hook["namespaceSelector"] == {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": NAMESPACED["watch"]["namespaces"]}]}
    own = {"matchLabels": {"team": "rl"}}
    (hook,) = one(render({"webhook": {"namespaceSelector": own, "failurePolicy": "Ignore"}}),
                  "ValidatingWebhookConfiguration")["webhooks"]
    assert hook["namespaceSelector"] == own and hook["failurePolicy"] == "Ignore"
    off = render({"webhook": {"enabled": False}})
    assert not find(off, "ValidatingWebhookConfiguration") and not find(off, "Secret")
    assert not any(a.startswith("--webhook") for a in _operator_args(off))
    assert "webhook" not in {p["name"] for p in operator_container(off)["ports"]}
