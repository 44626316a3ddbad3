"""Per-role pod template overrides: a partial core/v1 PodTemplateSpec (spec.<role>.template), mirrored field by
field so the API server checks what a user adds, and what the operator owns is refused naming the field. Merged into
the operator's pods by controller/manifests/podtemplate.py."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from rlkube.api.base import PRESERVE, Model, Quantity


class TemplateMetadata(Model):
    labels: dict[str, str] = Field(default_factory=dict, description="Labels added to every pod of the role.")
    annotations: dict[str, str] = Field(
        default_factory=dict, description="Annotations added to every pod of the role."
    )


class Toleration(Model):
    key: str | None = Field(None, description="Taint key (empty with operator Exists: every taint).")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Exists or Equal (default).")
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate (empty: every effect)."
    )
    toleration_seconds: int | None = Field(None, description="How long a NoExecute taint is tolerated.")


class LabelSelectorRequirement(Model):
    key: str = Field(..., min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = Field(default_factory=list)


class LabelSelector(Model):
    match_labels: dict[str, str] = Field(default_factory=dict)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list)


class TopologySpreadConstraint(Model):
    max_skew: int = Field(..., ge=1, description="Most pods one topology domain may have over another.")
    topology_key: str = Field(..., min_length=1, description="Node label that defines a domain.")
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(
        ..., description="Whether the spread is a requirement or a preference."
    )
    label_selector: LabelSelector | None = Field(None, description="Pods counted in each domain.")
    min_domains: int | None = Field(None, ge=1)
    match_label_keys: list[str] = Field(default_factory=list)
    node_affinity_policy: Literal["Honor", "Ignore"] | None = None
    node_taints_policy: Literal["Honor", "Ignore"] | None = None


class Affinity(Model):
    """Kubernetes' Affinity by its three keys; each term list is kept as written (too big a type to model here)."""

    node_affinity: dict[str, Any] | None = Field(
        None, json_schema_extra=PRESERVE, description="core/v1 NodeAffinity, as in a pod spec."
    )
    pod_affinity: dict[str, Any] | None = Field(
        None, json_schema_extra=PRESERVE, description="core/v1 PodAffinity, as in a pod spec."
    )
    pod_anti_affinity: dict[str, Any] | None = Field(
        None, json_schema_extra=PRESERVE, description="core/v1 PodAntiAffinity (replaces the operator's own)."
    )


class LocalObjectReference(Model):
    name: str = Field(..., min_length=1)


class KeySelector(Model):
    name: str = Field(..., min_length=1, description="ConfigMap or Secret name.")
    key: str = Field(..., min_length=1)
    optional: bool | None = None


class FieldSelector(Model):
    field_path: str = Field(..., min_length=1, description="Downward API field, e.g. metadata.name.")
    api_version: str | None = None


class ResourceFieldSelector(Model):
    resource: str = Field(..., min_length=1)
    container_name: str | None = None
    divisor: Quantity | None = None


class EnvVarSource(Model):
    config_map_key_ref: KeySelector | None = None
    secret_key_ref: KeySelector | None = None
    field_ref: FieldSelector | None = None
    resource_field_ref: ResourceFieldSelector | None = None


class EnvVar(Model):
    name: str = Field(..., min_length=1, pattern=r"^[^=]+$")
    value: str | None = None
    value_from: EnvVarSource | None = None


class VolumeMount(Model):
    name: str = Field(..., min_length=1, description="A volume of the pod (yours, or the operator's tmp/dshm).")
    mount_path: str = Field(..., pattern=r"^/", description="Absolute path in the container.")
    sub_path: str | None = None
    sub_path_expr: str | None = None
    read_only: bool | None = None
    mount_propagation: Literal["None", "HostToContainer", "Bidirectional"] | None = None


class Volume(Model):
    """A core/v1 Volume: `name` plus one volume source, kept as written (too many source types to model)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=PRESERVE)
    name: str = Field(..., min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class SeccompProfile(Model):
    type: Literal["RuntimeDefault", "Unconfined", "Localhost"]
    localhost_profile: str | None = None


class AppArmorProfile(Model):
    type: Literal["RuntimeDefault", "Unconfined", "Localhost"]
    localhost_profile: str | None = None


class SELinuxOptions(Model):
    user: str | None = None
    role: str | None = None
    type: str | None = None
    level: str | None = None


class Capabilities(Model):
    add: list[str] = Field(default_factory=list)
    drop: list[str] = Field(default_factory=list)


class Sysctl(Model):
    name: str = Field(..., min_length=1)
    value: str


class PodSecurityContext(Model):
    run_as_user: int | None = Field(None, ge=0)
    run_as_group: int | None = Field(None, ge=0)
    run_as_non_root: bool | None = None
    fs_group: int | None = Field(None, ge=0)
    fs_group_change_policy: Literal["OnRootMismatch", "Always"] | None = None
    supplemental_groups: list[int] = Field(default_factory=list)
    seccomp_profile: SeccompProfile | None = None
    app_armor_profile: AppArmorProfile | None = None
    se_linux_options: SELinuxOptions | None = None
    sysctls: list[Sysctl] = Field(default_factory=list)


class SecurityContext(Model):
    allow_privilege_escalation: bool | None = None
    privileged: bool | None = None
    read_only_root_filesystem: bool | None = None
    run_as_user: int | None = Field(None, ge=0)
    run_as_group: int | None = Field(None, ge=0)
    run_as_non_root: bool | None = None
    capabilities: Capabilities | None = None
    seccomp_profile: SeccompProfile | None = None
    app_armor_profile: AppArmorProfile | None = None
    se_linux_options: SELinuxOptions | None = None


def _refuse_owned(data: Any, owned: dict[str, str]) -> Any:
    """A field the operator sets is refused by name (`where` says what to use instead), not as an unknown field."""
    if isinstance(data, dict):
        for name, where in owned.items():
            if name in data:
                raise PydanticCustomError("operator_owned", "{field}: set by the operator ({where})",
                                          {"field": name, "where": where})
    return data


_OWNED_CONTAINER_FIELDS = {
    "command": "the role's module", "args": "the role's module", "image": "use spec.<role>.image",
    "resources": "use spec.<role>.resources", "ports": "the role's ports", "readinessProbe": "the role's probe",
    "livenessProbe": "the role's probes", "startupProbe": "the role's probes", "workingDir": "the image's",
    "terminationMessagePolicy": "the roles write a termination message", "envFrom": "list variables in env",
}
_OWNED_POD_FIELDS = {
    "restartPolicy": "use spec.runPolicy.restartPolicy", "hostname": "the role's stable name",
    "subdomain": "the role's headless Service", "terminationGracePeriodSeconds": "use spec.teardown",
    "enableServiceLinks": "off, so Service env cannot shadow the role's", "initContainers": "not supported",
}


class ContainerOverride(Model):
    """What may be added to the role's container (named after the role: trainer, inference, ..., redis)."""

    name: str = Field(..., min_length=1, description="The role's container: trainer, inference, actor, "
                                                     "preprocessor or redis.")
    env: list[EnvVar] = Field(
        default_factory=list,
        description="Variables merged by name; the operator's (rank, Redis, addresses) cannot be overridden.",
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, description="Mounts merged by mountPath; the job config and checkpoints are the "
                                          "operator's.",
    )
    security_context: SecurityContext | None = Field(
        None, description="Merged field by field over the operator's hardened container securityContext."
    )

    @model_validator(mode="before")
    @classmethod
    def _owned(cls, data: Any) -> Any:
        return _refuse_owned(data, _OWNED_CONTAINER_FIELDS)


class PodSpecOverride(Model):
    node_selector: dict[str, str] = Field(default_factory=dict, description="Merged key by key.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Added to the pod's.")
    affinity: Affinity | None = Field(
        None, description="Each key given (nodeAffinity, podAffinity, podAntiAffinity) replaces the operator's."
    )
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(
        default_factory=list, description="Merged by topologyKey."
    )
    priority_class_name: str | None = Field(None, min_length=1)
    service_account_name: str | None = Field(None, min_length=1)
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, description="Merged by name.")
    runtime_class_name: str | None = Field(None, min_length=1)
    automount_service_account_token: bool | None = Field(
        None, description="The operator sets false on every role pod (no role talks to the API server); true mounts "
        "the ServiceAccount's token for a process of yours that does."
    )
    security_context: PodSecurityContext | None = Field(
        None, description="Merged field by field over the operator's hardened pod securityContext."
    )
    volumes: list[Volume] = Field(
        default_factory=list,
        description="Merged by name: yours are added, or replace the operator's `tmp` and `dshm` (e.g. a "
                    "sizeLimit); `job-config` and `checkpoints` are the operator's.",
    )
    containers: list[ContainerOverride] = Field(
        default_factory=list, description="At most one: the role's container, by name."
    )

    @model_validator(mode="before")
    @classmethod
    def _owned(cls, data: Any) -> Any:
        return _refuse_owned(data, _OWNED_POD_FIELDS)


class PodTemplate(Model):
    """A partial pod template merged into what the operator builds for a role (controller/manifests/podtemplate.py)."""

    metadata: TemplateMetadata = Field(default_factory=TemplateMetadata, description="Labels and annotations.")
    spec: PodSpecOverride = Field(default_factory=PodSpecOverride, description="Placement, identity, security, "
                                                                               "env and volumes.")


TEMPLATE_DESCRIPTION = (
    "Partial pod template merged into this role's pods (a Kubernetes PodTemplateSpec subset): metadata labels/"
    "annotations, placement, identity, securityContext, env, volumes and mounts. Lists merge by name; what the "
    "operator owns (rank env, Redis password, command, its labels and volumes) is refused naming the field."
)
