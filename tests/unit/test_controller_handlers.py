"""The kopf wiring: explicit handler ids, timeouts at start-up, no diff-base, and what wakes a job's loop."""

from __future__ import annotations

import kopf
import orjson
import pytest

from rlkube.controller.process import handlers


def _body() -> dict:
    return {
        "apiVersion": "rlkube.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {
            "name": "tj", "namespace": "ns", "uid": "u", "resourceVersion": "7", "generation": 2,
            "labels": {"team": "rl"},
            "annotations": {"note": "x", "rlkube.io/last-handled-configuration": "{}",
                            "kubectl.kubernetes.io/last-applied-configuration": "{}"},
            "ownerReferences": [{"kind": "Thing", "name": "o", "uid": "1", "apiVersion": "v1"}],
            "managedFields": [{"manager": "rlkube", "fieldsV1": {"f:status": {}}}],
            "finalizers": ["rlkube.io/teardown"],
        },
        "spec": {"algorithm": {"maxSteps": 3}, "runPolicy": {"suspend": False}},
        "status": {"phase": "Running", "conditions": [{"type": "TrainerReady", "status": "True"}] * 50},
    }


def test_kopf_sees_no_change_in_any_event_and_stores_no_diffbase():
    # A constant essence: kopf's change detection finds nothing to do (NOOP), so it never PATCHes an annotation.
    from kopf._core.intents import causes

    storage = handlers.NoDiffBaseStorage()
    body = kopf.Body(_body())
    changed = kopf.Body({**_body(), "spec": {"algorithm": {"maxSteps": 9}}})
    assert storage.fetch(body=body) == storage.build(body=changed)
    patch = kopf.Patch()
    storage.store(body=body, patch=patch, essence=storage.build(body=changed))
    assert not patch
    cause = causes.detect_changing_cause(
        finalizer="rlkube.io/teardown", raw_event={"type": "MODIFIED", "object": dict(changed)}, body=changed,
        old=storage.fetch(body=changed), new=storage.build(body=changed), diff=(), resource=None, indices=None,
        logger=None, patch=kopf.Patch(), memo=None,
    )
    assert cause.reason == causes.Reason.NOOP


def test_a_loop_is_woken_by_spec_and_label_changes_not_by_its_own_status_writes():
    from rlkube.controller.reconcile.loop import JobLoop, Shared

    loop = JobLoop(Shared(kube=None), "ns", "tj")
    body = _body()
    assert loop.trigger_changed(body)  # no pass yet
    loop.trigger = loop._trigger(body)  # what a pass records
    assert not loop.trigger_changed({**body, "status": {"phase": "Succeeded"}})
    assert not loop.trigger_changed({**body, "metadata": {**body["metadata"], "resourceVersion": "8"}})
    assert loop.trigger_changed({**body, "metadata": {**body["metadata"], "generation": 3}})
    assert loop.trigger_changed({**body, "metadata": {**body["metadata"], "labels": {"kueue.x-k8s.io/queue-name": "q"}}})
    annotations = body["metadata"]["annotations"]
    touched = {**body, "metadata": {**body["metadata"], "annotations": {**annotations, "test/touch": "1"}}}
    assert loop.trigger_changed(touched)  # a user's annotation: as kopf's update handler saw it
    kopfs = {**body, "metadata": {**body["metadata"], "annotations": {**annotations, "rlkube.io/job-delete": "{}"}}}
    assert not loop.trigger_changed(kopfs)  # kopf's own progress annotations are not a change


def test_registry_has_explicit_handler_ids():
    registry = handlers.build_registry()
    ids = {h.id for h in registry._changing.get_all_handlers()} | {h.id for h in registry._spawning.get_all_handlers()}
    ids |= {h.id for h in registry._watching.get_all_handlers()} | {h.id for h in registry._indexing.get_all_handlers()}
    assert {"job-delete", "job-loop", "job-event", "pod-changed",
            "pods_by_job", "configmaps_by_job", "secrets_by_job", "services_by_job", "configmaps-deleted",
            "secrets-deleted", "services-deleted"} <= ids
    # Creation/update/resume handlers would need kopf's diff-base annotation (a PATCH per job): the loop does it.
    assert not {h.id for h in registry._changing.get_all_handlers()} - {"job-delete"}


def test_startup_sets_watch_and_request_timeouts_and_the_finalizer():
    settings = kopf.OperatorSettings()
    handlers.apply_settings(settings)
    assert settings.watching.server_timeout == 120 and settings.watching.client_timeout == 150
    assert settings.networking.request_timeout == 60
    assert settings.persistence.finalizer == "rlkube.io/teardown"
    assert settings.queueing.idle_timeout == handlers.IDLE_WORKER_SECONDS == 0.5
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert isinstance(settings.persistence.diffbase_storage, handlers.NoDiffBaseStorage)


def test_actions_go_in_waves_of_one_kind_in_the_decisions_order():
    from rlkube.controller.decisions.actions import Create, DeleteObject, DeletePod, DeleteStreams
    from rlkube.controller.reconcile.job_io import waves

    def create(kind: str, name: str) -> Create:
        return Create({"kind": kind, "metadata": {"name": name}})

    cm, svc, trainer, inference = create("ConfigMap", "c"), create("Service", "s"), create("Pod", "t"), create("Pod", "i")
    assert waves([cm, svc, trainer, inference]) == [[cm, svc], [trainer, inference]]
    a, b = DeletePod("a", "1", 10, "actor"), DeletePod("b", "2", 10, "actor")
    streams = DeleteStreams(("k",))
    obj1, obj2 = DeleteObject("ConfigMap", "c"), DeleteObject("Service", "s")
    assert waves([a, b, streams, obj1, obj2]) == [[a, b], [streams], [obj1, obj2]]
    assert waves([streams, streams]) == [[streams], [streams]]  # kinds without a wave run one at a time
    assert waves([]) == []


def test_kopf_decodes_watch_events_with_orjson_and_trims_them():
    import inspect

    from kopf._cogs.clients import api as kopf_api

    from rlkube.controller.process import watchdecode

    # Where kopf decodes watch lines: the name this shim replaces (a kopf upgrade that moves it fails here).
    assert "json.loads(line.decode(" in inspect.getsource(kopf_api.stream)
    assert watchdecode.install()
    assert kopf_api.json.loads is watchdecode.loads
    assert watchdecode.install()  # idempotent
    meta = {"name": "p", "labels": {"a": "b"}, "managedFields": [{"manager": "x"}],
            "annotations": {"keep": "1", watchdecode.LAST_APPLIED: "{}"}}
    pod = {"kind": "Pod", "metadata": meta, "spec": {"containers": []}, "status": {"phase": "Running"}}
    line = orjson.dumps({"type": "MODIFIED", "object": pod})
    assert kopf_api.json.loads(line) == {"type": "MODIFIED", "object": {
        "kind": "Pod", "metadata": {"name": "p", "labels": {"a": "b"}, "annotations": {"keep": "1"}},
        "status": {"phase": "Running"}}}
    job = {"kind": "TrainingJob", "metadata": {"name": "j", "managedFields": []}, "spec": {"a": 1}, "status": {}}
    assert watchdecode.loads(orjson.dumps({"type": "ADDED", "object": job}))["object"] == {
        "kind": "TrainingJob", "metadata": {"name": "j"}, "spec": {"a": 1}, "status": {}}
    secret = {"kind": "Secret", "metadata": {"name": "s"}, "data": {"password": "c2VjcmV0"}, "type": "Opaque"}
    assert watchdecode.loads(orjson.dumps({"type": "ADDED", "object": secret}))["object"] == {
        "kind": "Secret", "metadata": {"name": "s"}, "type": "Opaque"}
    error = {"type": "ERROR", "object": {"kind": "Status", "code": 410}}
    assert watchdecode.loads(orjson.dumps(error)) == error  # kopf reads the code of an ERROR event


def test_children_are_watched_by_their_label_server_side():
    settings = kopf.OperatorSettings()
    handlers.apply_settings(settings)
    selected = {sel: settings.watching.label_selectors[sel] for sel in settings.watching.label_selectors}
    assert set(selected.values()) == {"app.kubernetes.io/managed-by=rlkube"}
    plurals = {sel.plural or sel.any_name for sel in selected}
    assert plurals == {"pods", "configmaps", "secrets", "services", "networkpolicies", "workloads"}


def test_kopf_connections_are_bounded_by_requests_plus_one_per_watch():
    one = handlers.kopf_connection_limit(())
    assert one == handlers.REQUEST_CONNECTIONS + handlers.WATCHES_PER_SCOPE + handlers.WATCHES_EXTRA
    assert handlers.kopf_connection_limit(["a"]) == one
    # Each named namespace is watched on its own: the bound grows with them, never starving requests.
    assert handlers.kopf_connection_limit(["a", "b", "c"]) == one + 2 * handlers.WATCHES_PER_SCOPE
    # A pattern matches an unknown number of namespaces (so of watches): no bound at all.
    for pattern in ("team-*", "!kube-system", "a,b", "ns-?"):
        assert handlers.kopf_connection_limit(["a", pattern]) == 0


KUBECONFIG = """
apiVersion: v1
kind: Config
current-context: ctx
contexts: [{name: ctx, context: {cluster: c, user: u, namespace: ns}}]
clusters: [{name: c, cluster: {server: "https://10.0.0.1:6443", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: secret-token}}]
"""


async def test_login_gives_kopf_a_session_with_the_bound_and_the_kubeconfigs_credentials(tmp_path, monkeypatch):
    (tmp_path / "config").write_text(KUBECONFIG)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "config"))
    result = await handlers.login_handler(50)(logger=None, settings=kopf.OperatorSettings())
    assert isinstance(result, kopf.AiohttpSession)
    try:
        assert result.server == "https://10.0.0.1:6443" and result.default_namespace == "ns"
        assert result.aiohttp_session.connector.limit == 50
        assert result.aiohttp_session.headers["Authorization"] == "Bearer secret-token"
    finally:
        await result.aiohttp_session.close()
    # No bound wanted (namespace patterns): kopf builds its own session from the credentials.
    info = await handlers.login_handler(0)(logger=None, settings=kopf.OperatorSettings())
    assert isinstance(info, kopf.ConnectionInfo) and info.token == "secret-token"


async def test_login_without_credentials_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    with pytest.raises(kopf.LoginError, match="KUBECONFIG"):
        await handlers.login_handler(50)(logger=None, settings=kopf.OperatorSettings())


def test_the_operator_reads_tls_sockets_in_small_chunks(monkeypatch):
    from asyncio import sslproto

    from rlkube.controller.process import main

    monkeypatch.setattr(sslproto.SSLProtocol, "max_size", 256 * 1024)  # restored after the test
    main.small_tls_read_buffers()
    assert sslproto.SSLProtocol.max_size == main.TLS_READ_BUFFER == 32 * 1024
