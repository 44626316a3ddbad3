"""What a running job lacks, created: the static children and each role's pods through its start gate
(docs/design.md §3), a child deleted by hand recreated with a Warning (§4.5), and the phase while the job starts.
"""

from __future__ import annotations

from rlkube.api.role import Role
from rlkube.controller.decisions.actions import Create
from rlkube.controller.decisions.pass_state import Pass, set_phase
from rlkube.controller.decisions.times import fmt_time
from rlkube.controller.manifests import builders, names
from rlkube.lifecycle import roles
from rlkube.lifecycle.phases import EventType, Phase, Reason


def create_missing(p: Pass) -> None:
    job = p.job.ref
    if any(f"{kind}/{name}" not in p.obs.static_present for kind, name in static_names(p)):
        for manifest in builders.static_children(job):
            kind, name = manifest["kind"], manifest["metadata"]["name"]
            if f"{kind}/{name}" not in p.obs.static_present:
                # The managed Redis password: minted by the applier for this creation only, never by a pass.
                p.actions.append(Create(manifest, mint=names.SECRET_KEY if kind == "Secret" else None))
                if not p.fresh:
                    p.event(EventType.WARNING, Reason.CHILD_RECREATED,
                            f"{kind} {name} was missing (deleted by hand?); recreated it")
    present = {pod.name for pod in p.obs.pods}
    gated = p.status.phase in (Phase.PENDING, Phase.STARTING)
    exist = {r: sum(n in present for n in builders.pod_names(job, r)) for r in roles.START_ORDER}
    ready = {r: c.ready for r, c in p.status.components.items()}
    ckpt = p.status.trainer.last_checkpoint
    for role in roles.START_ORDER:  # each gate sees what this pass already created
        # A role none of whose pods exists starts through its gate in any phase: the trainer's first event turns the
        # job Running while the sandbox pods (or inference) may not be ready yet, and the actors must still wait.
        first = exist[role] == 0
        if (gated or first) and not roles.may_start(job.spec, role, roles.StartState(exist, ready)):
            continue
        for i in range(roles.replicas(job.spec, role)):
            if names.pod_name(job.name, role, i) in present:
                continue
            resume = ckpt.path if (role == Role.TRAINER and ckpt) else None
            placement = p.gate.placements.get(role)
            p.actions.append(Create(builders.pod(job, role, i, resume_checkpoint=resume, placement=placement)))
            present.add(names.pod_name(job.name, role, i))
            exist[role] += 1


def update_phase(p: Pass) -> None:
    st = p.status
    if st.phase in (Phase.PENDING, Phase.STARTING):
        anything_running = any(pod.running for pod in p.obs.pods)
        all_ready = all(c.ready >= c.desired for c in st.components.values())
        if all_ready or st.trainer.last_event_id is not None:
            set_phase(p, Phase.RUNNING, Reason.ALL_COMPONENTS_READY if all_ready else Reason.TRAINER_REPORTING)
            st.running_since = fmt_time(p.now)
        elif anything_running:
            set_phase(p, Phase.STARTING, Reason.COMPONENTS_STARTING, "waiting for every component to be Ready")
        else:
            set_phase(p, Phase.PENDING, Reason.PODS_PENDING, "children created, no pod running yet")


def static_names(p: Pass) -> list[tuple[str, str]]:
    job = p.job.name
    out = [("ConfigMap", names.config_name(job))]
    managed = p.spec is None or p.spec.redis.mode == "managed"
    if managed:
        out += [("Secret", names.secret_name(job)), ("NetworkPolicy", names.network_policy_name(job))]
    if p.spec is None:
        out += [("Service", names.service_name(job, r)) for r in names.SERVICE_ROLES
                if r not in (Role.REDIS, Role.SANDBOX) or (r == Role.REDIS and managed)]
        return out
    if roles.uses_sandbox_pods(p.spec):
        out.append(("NetworkPolicy", names.sandbox_network_policy_name(job)))
    out += [("Service", names.service_name(job, r)) for r in builders.service_roles(p.spec)]
    return out
