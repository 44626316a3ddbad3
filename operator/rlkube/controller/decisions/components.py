"""Each role's component in the status: desired, ready and restart counts and its Ready condition; a pod that
ended too early replaced, its restarts counted once and kept after it is gone.
"""

from __future__ import annotations

from rlkube.api.role import Role
from rlkube.api.status import ComponentStatus
from rlkube.controller.decisions.actions import DeletePod
from rlkube.controller.decisions.conditions import ROLE_CONDITIONS
from rlkube.controller.decisions.observed import PodView
from rlkube.controller.decisions.pass_state import Pass
from rlkube.lifecycle import roles
from rlkube.lifecycle.phases import ConditionStatus, EventType, PodPhase, Reason

REPLACED_MEMORY = 20
"""How many replaced-pod UIDs a component remembers (enough: a UID matters only while its pod exists)."""


def _restarts(p: Pass, role: str, comp: ComponentStatus) -> int:
    return comp.restarts_of_replaced_pods + sum(
        pod.restart_count for pod in p.obs.role_pods(role) if pod.uid not in comp.replaced_pods
    )


def update_components(p: Pass, stopping: bool) -> None:
    spec = p.spec
    for role in roles.START_ORDER:
        desired = roles.replicas(spec, role) if spec else 0
        if role == Role.SANDBOX and desired == 0 and role not in p.status.components and not p.obs.role_pods(role):
            continue  # snippets run in the actors' processes (spec.sandbox.mode): no component to report
        comp = p.status.components.get(role) or ComponentStatus()
        comp = comp.model_copy(deep=True)
        comp.desired = desired
        live = p.live(role)
        comp.ready = sum(1 for pod in live if pod.ready and pod.phase == PodPhase.RUNNING)
        counted = _restarts(p, role, comp)
        if counted < comp.restarts:
            # A pod with restarts is gone (deleted by teardown or by hand): keep what it had counted.
            comp.restarts_of_replaced_pods += comp.restarts - counted
            counted = comp.restarts
        comp.restarts = counted
        p.status.components[role] = comp
        ctype = ROLE_CONDITIONS[role]
        if stopping:
            left = len(p.obs.role_pods(role))
            p.condition(ctype, ConditionStatus.FALSE, Reason.STOPPED, f"{left} pod(s) left" if left else "",
                        event=False)
        elif desired == 0 and role == Role.SANDBOX:
            p.condition(ctype, ConditionStatus.FALSE, Reason.STOPPED, "spec.sandbox.mode is process", event=False)
        elif desired == 0:
            # External Redis: ready means the operator can read the job's events from it.
            reachable = p.obs.event_source.state == "Reachable"
            p.condition(ctype, ConditionStatus.TRUE if reachable else ConditionStatus.FALSE, Reason.EXTERNAL,
                        "external Redis (spec.redis.url)", event=False)
        elif comp.ready >= desired:
            # No Event: the phase's "-> Running: AllComponentsReady" says it for all of them at once (Events are
            # API writes: one per component per job adds up at scale); a pod that failed has its Warning.
            p.condition(ctype, ConditionStatus.TRUE, Reason.ALL_READY, f"{comp.ready}/{desired} ready", event=False)
        else:
            waiting = sorted({pod.waiting_reason for pod in live if pod.waiting_reason})
            detail = f"; waiting: {', '.join(waiting)}" if waiting else ""
            p.condition(ctype, ConditionStatus.FALSE, Reason.NOT_READY, f"{comp.ready}/{desired} ready{detail}",
                        event=False)
    p.status.trainer_restarts = p.status.components[Role.TRAINER].restarts


def replace_pod(p: Pass, pod: PodView, why: str) -> None:
    """Delete a pod that ended too early, counting it once; the creation path brings a fresh one."""
    comp = p.status.components[pod.role]
    comp.restarts_of_replaced_pods += pod.restart_count + 1
    comp.replaced_pods = (comp.replaced_pods + [pod.uid])[-REPLACED_MEMORY:]
    comp.restarts = _restarts(p, pod.role, comp)
    p.replaced_now.add(pod.uid)
    p.actions.append(DeletePod(pod.name, pod.uid, 0, pod.role))
    reason = Reason.TRAINER_RESTARTED if pod.role == Role.TRAINER else Reason.COMPONENT_RESTARTED
    p.event(EventType.WARNING, reason, f"pod {pod.name} {why}; replacing it")
