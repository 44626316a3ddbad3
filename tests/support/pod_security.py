"""The security assertion every child of a TrainingJob must pass (Pod Security Standards "restricted", plus what
the issue asks: read-only root where the role allows, no Secret value in any manifest). Shared by the builder
tests (every example) and the e2e tests (the pods as the API server stored them)."""

from __future__ import annotations

import json

WRITABLE_ROOT = {("inference", "vllm-gpu"), ("trainer", "fast-llm")}
"""(role, engine/backend) whose root filesystem stays writable (controller/manifests/builders.writable_root): vLLM
only with GPUs (a GPU trainer gives the vLLM servers GPUs, TrainingJobSpec.gpus_per_pod)."""


def assert_hardened_pod(pod: dict, spec: dict) -> None:
    """One Pod manifest (camelCase dict). `spec` is the TrainingJob spec it was built from (camelCase dict)."""
    name = pod["metadata"]["name"]
    role = pod["metadata"]["labels"]["rlkube.io/role"]
    ps = pod["spec"]
    psc = ps.get("securityContext") or {}
    assert psc.get("runAsNonRoot") is True and psc.get("runAsUser", 0) != 0, (name, psc)
    assert (psc.get("seccompProfile") or {}).get("type") == "RuntimeDefault", (name, psc)
    assert not ps.get("hostNetwork") and not ps.get("hostPID") and not ps.get("hostIPC"), name
    template = ((spec.get(role) or {}).get("template") or {}).get("spec") or {}
    if template.get("automountServiceAccountToken") is not True:
        assert_no_service_account_token(pod)
    for v in ps.get("volumes") or []:
        assert "hostPath" not in v, (name, v)
    engine = (spec.get("inference") or {}).get("engine", "vllm")
    if engine == "vllm" and ((spec.get("trainer") or {}).get("gpusPerNode") or 0) > 0:
        engine = "vllm-gpu"
    kind = {"inference": engine,
            "trainer": (spec.get("trainer") or {}).get("backend", "torch")}.get(role)
    for c in [*(ps.get("initContainers") or []), *ps["containers"]]:
        sc = c.get("securityContext") or {}
        where = f"{name}/{c['name']}"
        assert sc.get("allowPrivilegeEscalation") is False, (where, sc)
        assert sc.get("privileged") in (None, False), (where, sc)
        assert (sc.get("capabilities") or {}).get("drop") == ["ALL"], (where, sc)
        assert not (sc.get("capabilities") or {}).get("add"), (where, sc)
        assert sc.get("runAsUser", 1) != 0 and sc.get("runAsNonRoot", True) is True, (where, sc)
        assert sc.get("readOnlyRootFilesystem") is ((role, kind) not in WRITABLE_ROOT), (where, sc)
        if sc.get("readOnlyRootFilesystem"):
            # What a role writes goes to volumes: /tmp (and HOME) at least.
            mounts = {m["mountPath"] for m in c.get("volumeMounts") or []}
            if role != "redis":
                assert "/tmp" in mounts, (where, mounts)
        for env in c.get("env") or []:
            if env["name"] == "REDIS_PASSWORD":
                assert "value" not in env and "secretKeyRef" in env["valueFrom"], (where, env)
    if role == "sandbox":
        assert_sandbox_pod(pod, spec)


SERVICE_ACCOUNT_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def assert_no_service_account_token(pod: dict) -> None:
    """No ServiceAccount token in the pod (docs/guide/validation-and-security.md): the field false, and, where the
    API server's ServiceAccount admission ran, none of what it adds (a `kube-api-access-*` projected volume, or a
    `default-token-*` Secret volume before Kubernetes 1.22, mounted at the ServiceAccount path)."""
    name, ps = pod["metadata"]["name"], pod["spec"]
    assert ps.get("automountServiceAccountToken") is False, (name, ps.get("automountServiceAccountToken"))
    for v in ps.get("volumes") or []:
        assert not v["name"].startswith(("kube-api-access-", "default-token-")), (name, v)
        sources = (v.get("projected") or {}).get("sources") or []
        assert not any("serviceAccountToken" in src for src in sources), (name, v)
    for c in [*(ps.get("initContainers") or []), *ps["containers"]]:
        mounts = [m["mountPath"] for m in c.get("volumeMounts") or []]
        assert SERVICE_ACCOUNT_MOUNT not in mounts, (name, c["name"], mounts)


SANDBOX_UID = 10002  # controller/manifests/builders.SANDBOX_RUN_AS: no other role's


def assert_sandbox_pod(pod: dict, spec: dict) -> None:
    """What a sandbox pod holds beyond "restricted" (docs/guide/sandbox.md): spec.sandbox.runtimeClassName (gvisor
    unless set), no ServiceAccount token, a uid of its own, cpu/memory/ephemeral-storage limits, and nothing of the
    job's secrets or config: no Redis password, no Secret or ConfigMap of any kind, no env from one."""
    name, ps = pod["metadata"]["name"], pod["spec"]
    want = (spec.get("sandbox") or {}).get("runtimeClassName", "gvisor")
    assert ps.get("runtimeClassName") == want, (name, ps.get("runtimeClassName"), want)
    assert ps.get("automountServiceAccountToken") is False, name
    assert (ps.get("securityContext") or {}).get("runAsUser") == SANDBOX_UID, (name, ps.get("securityContext"))
    for v in ps.get("volumes") or []:
        assert not {"secret", "configMap", "projected", "persistentVolumeClaim"} & set(v), (name, v)
    for c in ps["containers"]:
        limits = (c.get("resources") or {}).get("limits") or {}
        assert {"cpu", "memory", "ephemeral-storage"} <= set(limits), (name, limits)
        for env in c.get("env") or []:
            assert env["name"] != "REDIS_PASSWORD", (name, env)
            assert "secretKeyRef" not in (env.get("valueFrom") or {}), (name, env)
            assert "configMapKeyRef" not in (env.get("valueFrom") or {}), (name, env)
        assert not c.get("envFrom"), (name, c.get("envFrom"))


def assert_no_secret_value(manifests: list[dict], secret_values: list[str]) -> None:
    """No manifest other than the Secret itself carries a Secret's value."""
    for m in manifests:
        if m["kind"] == "Secret":
            continue
        text = json.dumps(m)
        for value in secret_values:
            assert value not in text, f"{m['kind']}/{m['metadata']['name']} carries a Secret value"


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Kubernetes LabelSelector semantics (matchLabels and matchExpressions)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True
