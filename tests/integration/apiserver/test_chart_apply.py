"""charts/rlkube against real kube-apiservers.

1. The rendered ServiceAccount, RBAC, Deployment and Service are created on the shared test cluster, which
   validates them, and every field we sent comes back (kube-apiserver 1.20 silently drops fields it does not
   know from built-in types, so a misspelt field would otherwise pass unnoticed).
2. On a second control plane with `--authorization-mode=RBAC`, the chart is installed with the Helm SDK (as
   `helm install` would: CRDs from crds/, then the templates), and the API server's own authorizer answers
   SubjectAccessReviews for the operator's ServiceAccount: everything the operator does is allowed, where it
   should be, and nothing else. A kopf operator then runs with that ServiceAccount's token and handles a
   TrainingJob without a single permission error.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import helm_python as helm
import pytest
import yaml
from cluster.control_plane import ControlPlane
from support.helm_chart import CHART, FRAMEWORK_NEEDS, NAMESPACE_OBSERVATION, NOT_NEEDED, OPERATOR_NEEDS, find, render
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.dynamic import DynamicClient
from rlkube.bench import processes
from rlkube.local.ports import free_port
from support import specs
from support.waiting import wait_for

from support import DIR as SUPPORT
PEERING = {"peering": {"enabled": True}, "leaderElection": {"enabled": False}}


def _missing(sent, got, path="") -> list[str]:
    """Paths of everything in `sent` that is absent from, or different in, `got` (server defaults are fine)."""
    if isinstance(sent, dict):
        if not isinstance(got, dict):
            return [path or "."]
        out = []
        for key, value in sent.items():
            if key not in got:
                out.append(f"{path}.{key}")
            else:
                out += _missing(value, got[key], f"{path}.{key}")
        return out
    if isinstance(sent, list):
        if not isinstance(got, list) or len(sent) != len(got):
            return [path]
        return [m for i, (s, g) in enumerate(zip(sent, got)) for m in _missing(s, g, f"{path}[{i}]")]
    return [] if sent == got else [f"{path}: sent {sent!r}, got {got!r}"]


def _create_all(api_client, docs: list[dict], namespace: str) -> list[tuple[object, dict]]:
    dyn = DynamicClient(api_client)
    created = []
    for doc in docs:
        res = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        ns = doc["metadata"].get("namespace", namespace) if res.namespaced else None
        got = res.create(body=doc, namespace=ns).to_dict()
        created.append((res, got))
        missing = _missing({k: v for k, v in doc.items() if k != "metadata"}, got)
        missing += _missing(doc["metadata"].get("labels", {}), got["metadata"].get("labels", {}), "metadata.labels")
        assert not missing, f"{doc['kind']} {doc['metadata']['name']}: the API server dropped or changed {missing}"
    return created


@pytest.mark.parametrize("variant", ["cluster-wide", "namespaced"])
def test_rendered_chart_is_accepted_by_the_api_server(api_client, namespace, variant):
    release = f"r{uuid.uuid4().hex[:6]}"
    values = {} if variant == "cluster-wide" else {"watch": {"clusterWide": False}}
    docs = render(values, release=release, namespace=namespace)
    kinds = {d["kind"] for d in docs}
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service"} <= kinds
    if variant == "namespaced":
        assert {"Role", "RoleBinding"} <= kinds
    created = []
    try:
        created = _create_all(api_client, docs, namespace)
        apps = client.AppsV1Api(api_client)
        deploy = apps.read_namespaced_deployment(f"{release}-rlkube", namespace)
        assert deploy.spec.template.spec.service_account_name == f"{release}-rlkube"
        assert deploy.spec.template.spec.containers[0].liveness_probe.http_get.port == "healthz"
    finally:
        for res, got in created:
            if not res.namespaced:  # the namespace fixture removes the rest
                res.delete(name=got["metadata"]["name"])


def test_server_rejects_a_broken_render(api_client, namespace):
    # The acceptance above means something: the same Deployment with an invalid port name is refused.
    docs = render(release="bad", namespace=namespace)
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    deploy["spec"]["template"]["spec"]["containers"][0]["ports"][0]["name"] = "Not_A_Port_Name"
    with pytest.raises(ApiException) as err:
        _create_all(api_client, [deploy], namespace)
    assert err.value.status == 422 and "ports[0].name" in err.value.body


# --- a control plane with RBAC ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rbac_cluster(tmp_path_factory):
    from cluster.tracked import track

    cp = ControlPlane(tmp_path_factory.mktemp("rbac-cp"), with_controller_manager=False, authorization_mode="RBAC")
    cp.start()
    for name, proc in cp.procs.items():
        track(name, proc.pid)
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="module")
def rbac_api(rbac_cluster):
    api = config.new_client_from_config(config_file=str(rbac_cluster.kubeconfig))
    yield api
    api.close()


@pytest.fixture(scope="module")
def helm_in(rbac_cluster):
    """Helm action configs for the RBAC cluster, one per release namespace (where Helm keeps the release)."""
    configs = {}

    def get(namespace: str) -> helm.Config:
        if namespace not in configs:
            configs[namespace] = helm.Config(kubeconfig_path=rbac_cluster.kubeconfig, namespace=namespace)
        return configs[namespace]

    yield get
    for cfg in configs.values():
        cfg.close()


def _sa_user(namespace: str, name: str) -> dict:
    return {
        "user": f"system:serviceaccount:{namespace}:{name}",
        "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"],
    }


def _allowed(api, who: dict, group: str, resource: str, verb: str, namespace: str | None, name: str | None = None) -> bool:
    resource, _, sub = resource.partition("/")
    attrs = {"group": group, "resource": resource, "verb": verb}
    if name:
        attrs["name"] = name
    if sub:
        attrs["subresource"] = sub
    if namespace:
        attrs["namespace"] = namespace
    review = client.AuthorizationV1Api(api).create_subject_access_review(
        {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
         "spec": {**who, "resourceAttributes": attrs}}
    )
    return bool(review.status.allowed)


def _denials(api, who, needs, namespace) -> list:
    return [n for n in needs if not _allowed(api, who, *n, namespace)]


def _grants(api, who, extras, namespace) -> list:
    return [n for n in extras if _allowed(api, who, *n, namespace)]


def _ensure_namespace(api, name: str) -> None:
    try:
        client.CoreV1Api(api).create_namespace({"metadata": {"name": name}})
    except ApiException as exc:
        if exc.status != 409:
            raise


def _wait_established(api, names: list[str], timeout: float = 30) -> None:
    ext = client.ApiextensionsV1Api(api)
    deadline = time.monotonic() + timeout
    pending = set(names)
    while pending and time.monotonic() < deadline:
        for name in list(pending):
            conds = ext.read_custom_resource_definition(name).status.conditions or []
            if any(c.type == "Established" and c.status == "True" for c in conds):
                pending.discard(name)
        time.sleep(0.1)
    assert not pending, f"CRDs not Established: {pending}"


def test_helm_install_cluster_wide_with_peering(rbac_api, helm_in):
    release, ns = "cw", "rlkube-system"
    helm_config = helm_in(ns)
    rel = helm_config.install(CHART, release, PEERING, namespace=ns, create_namespace=True, timeout=60)
    try:
        assert rel["status"] == "deployed"
        _wait_established(rbac_api, ["trainingjobs.rlkube.io", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"])
        custom = client.CustomObjectsApi(rbac_api)
        assert custom.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", "rlkube")
        sa = _sa_user(ns, "cw-rlkube")
        for where in ("default", "any-namespace"):
            assert not _denials(rbac_api, sa, OPERATOR_NEEDS, where), where
            assert not _grants(rbac_api, sa, NOT_NEEDED, where), where
        assert not _denials(rbac_api, sa, FRAMEWORK_NEEDS, None)
        assert _grants(rbac_api, sa, NAMESPACE_OBSERVATION, None) == []  # a cluster-wide kopf never reads them
        assert not _denials(rbac_api, sa, [("kopf.dev", "clusterkopfpeerings", v) for v in ("get", "list", "watch", "patch")], None)
        assert _grants(rbac_api, sa, [("kopf.dev", "clusterkopfpeerings", "delete")], None) == []
        # The authorizer really decides: another ServiceAccount of the namespace gets nothing.
        assert _denials(rbac_api, _sa_user(ns, "default"), OPERATOR_NEEDS, "default") == OPERATOR_NEEDS
    finally:
        helm_config.uninstall(release, wait="watcher", timeout=60)
    rbac = client.RbacAuthorizationV1Api(rbac_api)
    assert not [r for r in rbac.list_cluster_role().items if r.metadata.name.startswith("cw-rlkube")]
    assert _denials(rbac_api, _sa_user(ns, "cw-rlkube"), OPERATOR_NEEDS[:3], "default") == OPERATOR_NEEDS[:3]


def test_helm_install_namespaced(rbac_api, helm_in):
    for name in ("team-a", "team-b"):
        _ensure_namespace(rbac_api, name)
    release, ns = "nsd", "rlkube-ops"
    helm_config = helm_in(ns)
    values = {"watch": {"clusterWide": False, "namespaces": ["team-a"]}, **PEERING}
    helm_config.install(CHART, release, values, namespace=ns, create_namespace=True, timeout=60)
    try:
        sa = _sa_user(ns, "nsd-rlkube")
        assert not _denials(rbac_api, sa, OPERATOR_NEEDS, "team-a")
        assert not _grants(rbac_api, sa, NOT_NEEDED, "team-a")
        # Nothing of the workload permissions outside the watched namespace.
        assert _grants(rbac_api, sa, OPERATOR_NEEDS, "team-b") == []
        assert _grants(rbac_api, sa, OPERATOR_NEEDS, ns) == []
        assert not _denials(rbac_api, sa, FRAMEWORK_NEEDS + NAMESPACE_OBSERVATION, None)
        assert not _denials(rbac_api, sa, [("kopf.dev", "kopfpeerings", v) for v in ("get", "list", "watch", "patch")], "team-a")
        assert _grants(rbac_api, sa, [("kopf.dev", "clusterkopfpeerings", "patch")], None) == []
        custom = client.CustomObjectsApi(rbac_api)
        assert custom.get_namespaced_custom_object("kopf.dev", "v1", "team-a", "kopfpeerings", "rlkube")
    finally:
        helm_config.uninstall(release, wait="watcher", timeout=60)


def _token_kubeconfig(api, cp: ControlPlane, namespace: str, sa: str, path: Path) -> Path:
    token = client.CoreV1Api(api).create_namespaced_service_account_token(
        sa, namespace, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                        "spec": {"audiences": ["https://kubernetes.default.svc"], "expirationSeconds": 3600}}
    ).status.token
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "local", "cluster": {"server": cp.url, "insecure-skip-tls-verify": True}}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "local", "user": "sa", "namespace": namespace}}],
    }))
    return path


PERMISSION_ERRORS = ("APIForbiddenError", "forbidden", "Forbidden", "Not enough permissions")


@pytest.mark.parametrize("mode", ["cluster-wide", "namespaced"])
def test_kopf_runs_with_the_chart_service_account(rbac_api, rbac_cluster, helm_in, tmp_path, mode):
    release, ns, team = f"kp{mode[0]}", f"rlkube-kopf-{mode}", f"team-k{mode[0]}"
    helm_config = helm_in(ns)
    _ensure_namespace(rbac_api, team)
    # kopf alone serves no admission webhook: the chart's would refuse every create (test_rlkube_operator_... serves it)
    values = {**PEERING, "webhook": {"enabled": False}}
    scope = ["--all-namespaces"]
    if mode == "namespaced":
        values["watch"] = {"clusterWide": False, "namespaces": [team]}
        scope = [f"--namespace={team}"]
    helm_config.install(CHART, release, values, namespace=ns, create_namespace=True, timeout=60)
    log = tmp_path / "kopf.log"
    proc = None
    try:
        kubeconfig = _token_kubeconfig(rbac_api, rbac_cluster, ns, f"{release}-rlkube", tmp_path / "sa-kubeconfig")
        # The same framework flags the chart gives `rlkube operator`: scope, peering, liveness.
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kopf", "run", *scope, "--peering=rlkube", "--verbose",
                 "--liveness=http://127.0.0.1:0/healthz", str(SUPPORT / "rbac_probe_operator.py")],
                env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        custom = client.CustomObjectsApi(rbac_api)
        body = specs.document()
        custom.create_namespaced_custom_object("rlkube.io", "v1alpha1", team, "trainingjobs", body)

        def handled():
            obj = custom.get_namespaced_custom_object("rlkube.io", "v1alpha1", team, "trainingjobs", "tiny-cpu")
            return obj if (obj.get("status") or {}).get("phase") == "Pending" and obj["metadata"].get("finalizers") else None

        # 180 s: kopf's start (imports, peering) under a loaded CI machine; a pass returns as soon as it is handled.
        obj = wait_for(handled, 180,
                       lambda: "kopf to handle the TrainingJob; its log: " + log.read_text()[-3000:], 0.2)
        assert obj["metadata"]["finalizers"]
        events = client.CoreV1Api(rbac_api).list_namespaced_event(team).items
        assert any(e.reason == "Probe" for e in events), [e.reason for e in events]
        if mode == "cluster-wide":
            peering = custom.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", "rlkube")
        else:
            peering = custom.get_namespaced_custom_object("kopf.dev", "v1", team, "kopfpeerings", "rlkube")
        assert peering.get("status"), "kopf did not register itself in the peering object"
        # Deletion goes through kopf's finalizer, which it must be allowed to remove.
        custom.delete_namespaced_custom_object("rlkube.io", "v1alpha1", team, "trainingjobs", "tiny-cpu")

        def gone():
            try:
                custom.get_namespaced_custom_object("rlkube.io", "v1alpha1", team, "trainingjobs", "tiny-cpu")
                return False
            except ApiException as exc:
                return exc.status == 404

        wait_for(gone, 180, lambda: "the TrainingJob to be released; its log: " + log.read_text()[-3000:], 0.2)
        text = log.read_text()
        errors = [line for line in text.splitlines() if any(sign in line for sign in PERMISSION_ERRORS)]
        assert not errors, "kopf hit permission errors:\n" + "\n".join(line[:400] for line in errors[:10])
        assert "probe handled tiny-cpu" in text and "probe released tiny-cpu" in text
    finally:
        if proc is not None:
            processes.stop(proc)
        helm_config.uninstall(release, wait="watcher", timeout=60)


def test_namespaced_render_for_the_shared_cluster_has_no_peering_objects():
    # The shared test cluster has no kopf.dev CRDs: the default and namespaced renders must not need them.
    assert not find(render(), "ClusterKopfPeering")
    assert not find(render({"watch": {"clusterWide": False}}), "KopfPeering")


def test_rlkube_operator_runs_with_the_chart_service_account(rbac_api, rbac_cluster, helm_in, tmp_path):
    """The real `rlkube operator`, with the arguments the chart renders (leader election on a Lease, the default),
    under the chart's ServiceAccount: it takes the Lease, creates a TrainingJob's children and tears them down on
    deletion without a permission error."""
    from support.helm_chart import operator_container

    release, ns, team = "op", "rlkube-op", "team-op"
    _ensure_namespace(rbac_api, team)
    values = {"metrics": {"enabled": False}}
    helm_config = helm_in(ns)
    helm_config.install(CHART, release, values, namespace=ns, create_namespace=True, timeout=60)
    args = operator_container(render(values, release=release, namespace=ns))["args"]
    assert "--leader-elect" in args and f"--lease-namespace={ns}" in args
    sa = _sa_user(ns, f"{release}-rlkube")
    lease_verbs = [("coordination.k8s.io", "leases", v) for v in ("get", "update")]
    # Its own Lease in the release namespace; no other Lease, and none elsewhere.
    assert not [n for n in lease_verbs if not _allowed(rbac_api, sa, *n, ns, name=f"{release}-rlkube")]
    assert _allowed(rbac_api, sa, "coordination.k8s.io", "leases", "create", ns)
    assert not any(_allowed(rbac_api, sa, *n, ns, name="kube-controller-manager") for n in lease_verbs)
    assert not any(_allowed(rbac_api, sa, "coordination.k8s.io", "leases", v, where)
                   for v in ("get", "create", "update", "delete") for where in (team, "kube-system"))
    # Same arguments, but the liveness endpoint on a free loopback port (the pod's 0.0.0.0:8081 may be taken), and
    # the webhook on a free port with a certificate for 127.0.0.1: the API server here reaches no Service, so the
    # chart's ValidatingWebhookConfiguration is pointed at that URL (its rules and policy are the chart's).
    webhook_port, certs = free_port(), _loopback_certificate(tmp_path / "webhook")
    args = [a if not a.startswith("--liveness=") else "--liveness=http://127.0.0.1:0/healthz" for a in args]
    args = [f"--webhook-port={webhook_port}" if a.startswith("--webhook-port=") else
            f"--webhook-cert-dir={certs}" if a.startswith("--webhook-cert-dir=") else a for a in args]
    admission_api = client.AdmissionregistrationV1Api(rbac_api)
    hook_name = f"{release}-rlkube-webhook.{ns}"
    admission_api.patch_validating_webhook_configuration(hook_name, [
        {"op": "replace", "path": "/webhooks/0/clientConfig", "value": {
            "url": f"https://127.0.0.1:{webhook_port}/validate-trainingjob",
            "caBundle": base64.b64encode((certs / "tls.crt").read_bytes()).decode()}}])
    log = tmp_path / "operator.log"
    proc = None
    try:
        kubeconfig = _token_kubeconfig(rbac_api, rbac_cluster, ns, f"{release}-rlkube", tmp_path / "sa-kubeconfig")
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "rlkube.cli", *args],
                env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        custom = client.CustomObjectsApi(rbac_api)
        core = client.CoreV1Api(rbac_api)
        _webhook_refuses_bad_jobs_at_apply_time(custom, core, team, log)
        body = specs.document()
        custom.create_namespaced_custom_object("rlkube.io", "v1alpha1", team, "trainingjobs", body)

        def children():
            kinds = {
                "Pod": core.list_namespaced_pod(team).items,
                "Service": core.list_namespaced_service(team).items,
                "Secret": [s for s in core.list_namespaced_secret(team).items if s.type != "kubernetes.io/service-account-token"],
                "ConfigMap": core.list_namespaced_config_map(team).items,
            }
            return kinds if all(kinds.values()) else None

        found = wait_for(children, 90,
                         lambda: "the operator to create children; its log: " + log.read_text()[-3000:], 0.2)
        assert all(o.metadata.owner_references for objs in found.values() for o in objs)
        job = custom.get_namespaced_custom_object("rlkube.io", "v1alpha1", team, "trainingjobs", "tiny-cpu")
        assert (job.get("status") or {}).get("phase"), "the operator wrote no status"
        custom.delete_namespaced_custom_object("rlkube.io", "v1alpha1", team, "trainingjobs", "tiny-cpu")

        def released():
            try:
                custom.get_namespaced_custom_object("rlkube.io", "v1alpha1", team, "trainingjobs", "tiny-cpu")
                return False
            except ApiException as exc:
                return exc.status == 404

        wait_for(released, 120, lambda: "the TrainingJob to be released; its log: " + log.read_text()[-3000:], 0.2)
        text = log.read_text()
        errors = [line for line in text.splitlines() if any(sign in line for sign in PERMISSION_ERRORS)]
        assert not errors, "the operator hit permission errors:\n" + "\n".join(line[:400] for line in errors[:10])
        lease = client.CoordinationV1Api(rbac_api).read_namespaced_lease(f"{release}-rlkube", ns)
        assert lease.spec.holder_identity and lease.spec.lease_duration_seconds == 15
        assert f"leading: lease {ns}/{release}-rlkube created" in text
        # A standby's watch, as the API server authorizes it for real: a metadata.name field selector is checked
        # against the Role's resourceNames; the same request without it is refused.
        from kubernetes import watch

        sa_api = config.new_client_from_config(config_file=str(kubeconfig))
        try:
            coord = client.CoordinationV1Api(sa_api)
            named = f"metadata.name={release}-rlkube"
            seen = [e["object"].metadata.name for e in
                    watch.Watch().stream(coord.list_namespaced_lease, ns, field_selector=named, timeout_seconds=1)]
            # ADDED, then a MODIFIED for each renewal that lands within the watch's second.
            assert seen and set(seen) == {f"{release}-rlkube"}, seen
            with pytest.raises(ApiException) as denied:
                coord.list_namespaced_lease(ns)
            assert denied.value.status == 403
        finally:
            sa_api.close()
    finally:
        if proc is not None:
            processes.stop(proc, timeout=30)
        helm_config.uninstall(release, wait="watcher", timeout=60)


def _loopback_certificate(directory: Path) -> Path:
    """A self-signed tls.crt/tls.key for 127.0.0.1 (the webhook Secret's file names)."""
    directory.mkdir(parents=True)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(directory / "tls.key"),
                    "-out", str(directory / "tls.crt")], check=True, capture_output=True)
    return directory


def _webhook_refuses_bad_jobs_at_apply_time(custom, core, team: str, log: Path) -> None:
    """`kubectl apply --dry-run=server` (and a real create) of a job the operator would fail is refused by the
    chart's webhook, served by `rlkube operator`, naming the field; nothing is stored and no child exists. A valid
    job passes the same dry run."""
    cross_field = specs.document(**{"spec.trainer.nodes": 4, "spec.algorithm.samplesPerStep": 2})
    bad_image = specs.document(**{"spec.actor.image": "my image:latest"})
    long_name = specs.document(**{"metadata.name": "j" * 60})
    # The validation gaps the schema cannot express (tests/unit/test_validation_gaps.py): refused naming the field.
    two_sources = specs.document(**{"spec.task.environment": {"name": "calculator"},
                                    "spec.task.reasoningGym": {"name": "basic_arithmetic"}})
    reserved = specs.document(**{"spec.task.reasoningGym": {"name": "basic_arithmetic", "config": {"size": 5}}})
    sft = specs.document(**{"spec.algorithm.loss": "sft", "spec.task.dataset": {"path": "/data/prompts.jsonl"}})
    cases = [(cross_field, "spec.algorithm.samplesPerStep: must be at least the trainer's ranks"),
             (bad_image, "spec.actor.image: 'my image:latest' is not an image reference"),
             (long_name, "metadata.name: '" + "j" * 60 + "' is too long"),
             (two_sources, "spec.task.reasoningGym: not with spec.task.environment.name 'calculator', which draws "
                           "its own prompts"),
             (reserved, "spec.task.reasoningGym.config.size: reserved"),
             (sft, "spec.task.dataset.completionField: required with spec.algorithm.loss sft")]

    def dry_run(body):
        return custom.create_namespaced_custom_object("rlkube.io", "v1alpha1", team, "trainingjobs", body,
                                                      dry_run="All")

    def serving():  # the operator process starts the webhook before it campaigns for the Lease
        try:
            return dry_run(specs.document()) is not None
        except ApiException as exc:
            if exc.status == 500 and "failed calling webhook" in (exc.body or ""):
                return False
            raise

    wait_for(serving, 90, lambda: "the operator's webhook to answer; its log: " + log.read_text()[-3000:], 0.2)
    for body, says in cases:
        for run in (dry_run, lambda b: custom.create_namespaced_custom_object("rlkube.io", "v1alpha1", team,
                                                                             "trainingjobs", b)):
            with pytest.raises(ApiException) as refused:
                run(body)
            assert refused.value.status == 422, refused.value.body
            assert 'admission webhook \\"validate.trainingjobs.rlkube.io\\" denied the request' in refused.value.body
            assert says in refused.value.body, refused.value.body
            assert "spec.task.reward" not in refused.value.body, refused.value.body  # only the true error
    # A name the CRD's enum refuses never reaches the webhook: the API server names the field itself.
    with pytest.raises(ApiException) as refused:
        dry_run(specs.document(**{"spec.task.environment": {"name": "calculater"}}))
    assert refused.value.status == 422 and "admission webhook" not in refused.value.body, refused.value.body
    assert 'spec.task.environment.name: Unsupported value: \\"calculater\\"' in refused.value.body, \
        refused.value.body
    assert custom.list_namespaced_custom_object("rlkube.io", "v1alpha1", team, "trainingjobs")["items"] == []
    assert core.list_namespaced_pod(team).items == [] and core.list_namespaced_config_map(team).items == []
