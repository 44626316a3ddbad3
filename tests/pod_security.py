"""The security assertion every child of a TrainingJob must pass (Pod Security Standards "restricted", plus what
the issue asks: read-only root where the role allows, no Secret value in any manifest). Shared by the builder
tests (every example) and the e2e tests (the pods as the API server stored them)."""

from __future__ import annotations

import json

WRITABLE_ROOT = {("inference", "vllm-gpu"), ("trainer", "fast-llm")}
"""(role, engine/backend) whose root filesystem stays writable (controller/builders.writable_root): vLLM only with
GPUs (a GPU trainer gives the vLLM servers GPUs, TrainingJobSpec.gpus_per_pod)."""


def assert_hardened_pod(pod: dict, spec: dict) -> None:
    """One Pod manifest (camelCase dict). `spec` is the TrainingJob spec it was built from (camelCase dict)."""
    name = pod["metadata"]["name"]
    role = pod["metadata"]["labels"]["rlkube.io/role"]
    ps = pod["spec"]
    psc = ps.get("securityContext") or {}
    assert psc.get("runAsNonRoot") is True and psc.get("runAsUser", 0) != 0, (name, psc)
    assert (psc.get("seccompProfile") or {}).get("type") == "RuntimeDefault", (name, psc)
    assert not ps.get("hostNetwork") and not ps.get("hostPID") and not ps.get("hostIPC"), name
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
