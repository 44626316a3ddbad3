"""Generated TrainingJob specs (hypothesis, generated_specs.py) sent to the real kube-apiserver with ONE operator
process running, at least 500 of them, in batches created at once while the previous batch is being deleted.

Each case is checked against what it must do (generated_specs.Case):
- refused by the API server: 422, and its causes and message name every mutated path;
- accepted and invalid: the operator fails it (Failed, reason InvalidSpec) with a message naming the field, and
  no child of it exists, then or after the batch;
- accepted and valid: the operator creates its children (the ConfigMap and the first pods: the managed Redis pod,
  or with the test's external Redis, the trainer pods), every one owned by the job and labelled;
- accepted edge values: one of the two above, and a failed one leaves no child; which way each went is printed.
The operator's own verdict on the stored spec (rlkube.lifecycle.validation, after the API server's defaulting) must
agree with what the operator did. Throughout, the operator process stays alive; at the end every job is gone,
and a control job still gets its children and reads its Redis stream (malformed entries included) to the end.
No kubelet runs: pods stay Pending, which is all creation and validation need. Seed and counts are printed.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter

import pytest
from support.fuzz_seed import say, scaled, seed
from support.generated_specs import FIELD_IN_MESSAGE, Case, case
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.rest import ApiException
from support.operator_harness import OperatorProcess

from rlkube.lifecycle import roles
from rlkube.lifecycle.validation import SpecError, parse_spec
from rlkube.controller.manifests import names
from rlkube.contract import protocol

pytestmark = pytest.mark.timeout(1200)

GROUP, VERSION, PLURAL = "rlkube.io", "v1alpha1", "trainingjobs"
CASES = scaled(500)
BATCH = 10  # 25 specs of the grown schema overran hypothesis's buffer: only 3 of 20 batches were drawn
SETTLE_SECONDS = 90
SEED = seed()


def causes_of(exc: ApiException) -> tuple[list[str], str]:
    body = json.loads(exc.body)
    return [c.get("field", "") for c in (body.get("details") or {}).get("causes", [])], body.get("message", "")


def names_path(causes: list[str], message: str, path: str) -> bool:
    hit = any(c == path or c.startswith((path + ".", path + "[")) for c in causes)
    return hit and path in message


class Cluster:
    """The sync API calls of the test, in one namespace."""

    def __init__(self, api: client.ApiClient, namespace: str):
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.namespace = namespace

    def create(self, name: str, spec: dict) -> dict:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob", "metadata": {"name": name}, "spec": spec}
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)

    def delete(self, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def jobs(self) -> dict[str, dict]:
        items = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)["items"]
        return {j["metadata"]["name"]: j for j in items}

    def children(self) -> dict[str, list[dict]]:
        """Every object carrying our managed-by label, by the job it names. Read as JSON, not as the client's
        models: turning a hundred pods into V1Pod objects took about as long as the poll interval, every poll."""
        selector = f"{names.LABEL_MANAGED_BY}={names.MANAGED_BY}"
        out: dict[str, list[dict]] = {}
        for kind, lister in (("Pod", self.core.list_namespaced_pod), ("ConfigMap", self.core.list_namespaced_config_map),
                             ("Service", self.core.list_namespaced_service),
                             ("Secret", self.core.list_namespaced_secret)):
            items = json.loads(lister(self.namespace, label_selector=selector, _preload_content=False).data)["items"]
            for item in items:
                meta = item["metadata"]
                labels = meta.get("labels") or {}
                out.setdefault(labels.get(names.LABEL_JOB, ""), []).append(
                    {"kind": kind, "name": meta["name"], "labels": labels,
                     "owners": [(o["kind"], o["name"], o["uid"], o.get("controller"))
                                for o in meta.get("ownerReferences") or []],
                     "deleting": meta.get("deletionTimestamp") is not None})
        return out


def unique(name: str) -> str:
    """An edge case's own job name made unique, keeping what makes it an edge (length, dots, first character)."""
    tag = uuid.uuid4().hex[:5]
    return name[:-5] + tag if len(name) >= 40 else f"{name}-{tag}"


def failed(job: dict) -> dict | None:
    conds = (job.get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == "Failed" and c["status"] == "True"), None)


def first_pods(name: str, spec: dict) -> set[str]:
    """The pods the operator creates at once for a valid job with no kubelet: the managed Redis pod; with an
    external (reachable) Redis, the trainer and inference pods."""
    if spec["redis"]["mode"] == "managed":
        return {names.pod_name(name, "redis")}
    parsed = parse_spec(spec)  # a colocated engine has no pod of its own (lifecycle.roles.replicas)
    return {names.pod_name(name, role, i) for role in ("trainer", "inference")
            for i in range(roles.replicas(parsed, role))}


def settled(job: dict, kids: list[dict]) -> bool:
    phase = (job.get("status") or {}).get("phase")
    if failed(job) is not None:
        return phase == "Failed"
    if job["spec"]["runPolicy"]["suspend"]:
        return phase == "Suspended"  # a job created suspended: nothing to create yet
    present = {k["name"] for k in kids if k["kind"] == "Pod"}
    config = any(k["kind"] == "ConfigMap" for k in kids)
    return config and first_pods(job["metadata"]["name"], job["spec"]) <= present


def check_children(job: dict, kids: list[dict]) -> None:
    uid, name = job["metadata"]["uid"], job["metadata"]["name"]
    for kid in kids:
        assert kid["owners"] == [("TrainingJob", name, uid, True)], kid
        assert kid["labels"][names.LABEL_MANAGED_BY] == names.MANAGED_BY and kid["labels"][names.LABEL_JOB] == name
        if kid["kind"] == "Pod":
            assert kid["labels"][names.LABEL_ROLE] in roles.START_ORDER


def local_verdict(spec: dict) -> str | None:
    try:
        parse_spec(spec)
        return None
    except SpecError as exc:
        return str(exc)


def test_generated_specs_against_the_api_server_and_one_operator(cluster, api_client, crd, redis_server, tmp_path,
                                                                 capsys):
    say(capsys, f"TrainingJob specs: seed {SEED} (replay: RLKUBE_FUZZ_SEED={SEED}), {CASES} cases planned "
                f"in batches of {BATCH}")
    namespace = f"gen-{uuid.uuid4().hex[:8]}"
    k = Cluster(api_client, namespace)
    k.core.create_namespace({"metadata": {"name": namespace, "labels": {"rlkube.io/test": "true"}}})
    op = OperatorProcess(cluster, namespace, tmp_path).start()
    stats: Counter = Counter()
    edges: Counter = Counter()
    all_jobs: list[str] = []
    batch_seconds: list[float] = []
    t_start = time.monotonic()

    def run_batch(cases: list[Case]) -> None:
        t_batch = time.monotonic()
        accepted: dict[str, tuple[Case, dict]] = {}
        for c in cases:
            stats["cases"] += 1
            name = unique(c.name) if c.name else f"g{stats['cases']}-{uuid.uuid4().hex[:4]}"
            try:
                created = k.create(name, c.spec)
            except ApiException as exc:
                assert exc.status == 422, f"{c.what}: {exc.status} {exc.body}"
                causes, message = causes_of(exc)
                if c.expect == "schema":
                    missing = [f for f in c.fields if not names_path(causes, message, f)]
                    assert not missing, f"422 does not name {missing}: {c.what}\ncauses {causes}\n{message}"
                    stats["422"] += 1
                    continue
                if c.expect == "edge":  # a name the API server refuses for the object itself
                    assert FIELD_IN_MESSAGE.search(message), message
                    edges[f"{c.what[0]} -> 422"] += 1
                    stats["422"] += 1
                    continue
                raise AssertionError(f"{c.expect} case refused: {c.what}\n{message}\n{json.dumps(c.spec)[:2000]}")
            assert c.expect != "schema", f"accepted, expected 422 naming {c.fields}: {c.what}"
            all_jobs.append(name)
            accepted[name] = (c, created)

        deadline = time.monotonic() + SETTLE_SECONDS
        while True:
            assert op.proc.poll() is None, f"operator exited {op.proc.returncode}:\n{op.log()[-4000:]}"
            jobs, kids = k.jobs(), k.children()
            waiting = [n for n in accepted if not settled(jobs[n], kids.get(n, []))]
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise AssertionError("not settled in time: " + "; ".join(
                    f"{n} {accepted[n][0].what} status={jobs[n].get('status')} children={kids.get(n)}"
                    for n in waiting[:3]))
            time.sleep(0.5)  # polling lists: the API server has no cheaper "all of these settled" query

        for name, (c, created) in accepted.items():
            job, mine = jobs[name], kids.get(name, [])
            verdict = local_verdict(job["spec"])
            why = failed(job)
            if why is None:
                assert c.expect in ("valid", "edge"), f"{c.expect} case ran: {c.what}"
                assert verdict is None, f"the operator ran a spec it must refuse ({verdict}): {c.what}"
                check_children(job, mine)
                if job["spec"]["runPolicy"]["suspend"]:
                    assert not mine, f"children of a suspended job: {mine}"
                    stats["suspended"] += 1
                stats["ran"] += 1
                if c.expect == "edge" and not job["spec"]["runPolicy"]["suspend"]:
                    assert not c.fields, f"ran, must be refused naming {c.fields}: {c.what}"
                    edges[f"{c.what[0]} -> ran"] += 1
                continue
            message = why["message"]
            assert why["reason"] == "InvalidSpec", f"{c.what}: {why}"
            assert FIELD_IN_MESSAGE.search(message), f"no field named: {message}"
            if c.expect == "operator":
                assert all(f in message for f in c.fields), f"{c.fields} not in {message!r}"
                assert verdict is not None and all(f in verdict for f in c.fields), verdict
                assert mine == [], f"children of an invalid job: {mine}"
                stats["invalid"] += 1
            elif c.expect == "edge":
                if c.fields:  # a value the operator knows a Pod or Service refuses: refused up front, nothing made
                    assert all(f in message for f in c.fields) and mine == [], (c.what, message, mine)
                    stats["invalid"] += 1
                edges[f"{c.what[0]} -> InvalidSpec: {message[:160]}"] += 1
                stats["edge-failed"] += 1
            else:
                raise AssertionError(f"valid case failed: {c.what}: {message}")
        for name in accepted:
            k.delete(name)
        batch_seconds.append(round(time.monotonic() - t_batch, 1))

    @hypothesis_seed(SEED)
    @settings(max_examples=-(-CASES // BATCH), deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate],  # no shrinking: each run costs seconds of a real cluster
              suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(case(redis_server.url), min_size=BATCH, max_size=BATCH))
    def batches(batch):
        run_batch(batch)

    try:
        batches()
        # Every deleted job's ordered teardown finishes and nothing it owned is left.
        deadline = time.monotonic() + 180
        while k.jobs() or k.children():
            assert op.proc.poll() is None, f"operator exited:\n{op.log()[-4000:]}"
            assert time.monotonic() < deadline, f"left: {list(k.jobs())[:10]} {list(k.children())[:10]}"
            time.sleep(0.5)
        stats["seconds"] = round(time.monotonic() - t_start)

        # A control job afterwards: still served, and its Redis stream read to the end past malformed entries.
        control = "control"
        spec = {"model": {"path": "builtin://tiny-llama"}, "algorithm": {"maxSteps": 3},
                "inference": {"engine": "native"}, "redis": {"mode": "external", "url": redis_server.url}}
        k.create(control, spec)
        r = redis_server.client()
        stream = protocol.StreamKeys.for_job(namespace, control).events
        last = None
        for fields in ({"event": b"{nope"}, {"event": b"[1]"}, {"other": b"x"}, {"event": b'{"type": "??"}'},
                       {"event": b'{"type": "weights_ready", "step": 1e308}'}, protocol.weights_ready(1, 32),
                       {"event": b'{"type": "training_finished", "step": "3"}'}, {"event": b"\xff"}):
            last = protocol.text(r.xadd(stream, fields))
        r.close()
        deadline = time.monotonic() + 60
        while True:
            job, kids = k.jobs()[control], k.children().get(control, [])
            trainer = (job.get("status") or {}).get("trainer") or {}
            if settled(job, kids) and trainer.get("lastEventId") == last:
                break
            assert op.proc.poll() is None, f"operator exited:\n{op.log()[-4000:]}"
            assert time.monotonic() < deadline, f"control job: {job.get('status')} {kids}"
            time.sleep(0.2)
        assert failed(job) is None and job["status"]["trainer"]["step"] == 1
        assert job["status"]["phase"] == "Running"  # a trainer event: the job runs
        check_children(job, kids)
        k.delete(control)
    finally:
        say(capsys, f"TrainingJob specs: seed {SEED}: {stats['cases']} cases run in {stats.get('seconds', '?')} s: "
                    f"{stats['422']} refused by the API server (422), {stats['invalid']} failed InvalidSpec by the "
                    f"operator, {stats['ran']} ran ({stats['suspended']} created suspended), {stats['edge-failed']} edge cases "
                    f"failed InvalidSpec; seconds per batch {batch_seconds}")
        for what, n in sorted(edges.items()):
            say(capsys, f"  edge: {what} (x{n})")
        op.stop()
        k.core.delete_namespace(namespace)
    assert stats["cases"] >= CASES
