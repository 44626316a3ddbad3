{{/* Names, labels and the RBAC rules shared by the templates. */}}

{{- define "rlkube.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rlkube.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "rlkube.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rlkube.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "rlkube.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "rlkube.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rlkube
{{- end -}}

{{- define "rlkube.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rlkube.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "rlkube.image" -}}
{{- $repository := .Values.image.repository -}}
{{- if .Values.imageRegistry -}}
{{- $repository = printf "%s/operator" (trimSuffix "/" .Values.imageRegistry) -}}
{{- end -}}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The namespaces watched when not cluster-wide: the list, or the release namespace. */}}
{{- define "rlkube.watchedNamespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- .Values.watch.namespaces | toJson -}}
{{- else -}}
{{- list .Release.Namespace | toJson -}}
{{- end -}}
{{- end -}}

{{- define "rlkube.leaseName" -}}
{{- default (include "rlkube.fullname" .) .Values.leaderElection.leaseName -}}
{{- end -}}

{{/* Fail early on combinations the schema cannot express. */}}
{{- define "rlkube.validate" -}}
{{- $le := .Values.leaderElection -}}
{{- if and $le.enabled .Values.peering.enabled -}}
{{- fail "leaderElection.enabled and peering.enabled: choose one (leader election already lets exactly one replica act; kopf peering only pauses, it elects no leader)" -}}
{{- end -}}
{{- if and (gt (int .Values.replicas) 1) (not $le.enabled) -}}
{{- if not .Values.peering.enabled -}}
{{- fail (printf "replicas: %d standalone operators would all act on every TrainingJob; enable leaderElection or run one replica" (int .Values.replicas)) -}}
{{- else -}}
{{- fail (printf "replicas: %d operators would share one kopf peering priority, and kopf pauses every operator of equal priority, so none would act; use leaderElection for more than one replica" (int .Values.replicas)) -}}
{{- end -}}
{{- end -}}
{{- if $le.enabled -}}
{{- if not (gt (int $le.leaseDurationSeconds) (int $le.renewDeadlineSeconds)) -}}
{{- fail (printf "leaderElection.leaseDurationSeconds (%d) must exceed renewDeadlineSeconds (%d): the leader must stop before a standby may take over" (int $le.leaseDurationSeconds) (int $le.renewDeadlineSeconds)) -}}
{{- end -}}
{{- if not (gt (mul (int $le.renewDeadlineSeconds) 10) (mul (int $le.retryPeriodSeconds) 12)) -}}
{{- fail (printf "leaderElection.renewDeadlineSeconds (%d) must exceed 1.2 x retryPeriodSeconds (%d)" (int $le.renewDeadlineSeconds) (int $le.retryPeriodSeconds)) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.watch.clusterWide .Values.watch.namespaces -}}
{{- fail "watch.namespaces is set but watch.clusterWide is true: set watch.clusterWide=false to watch only those namespaces" -}}
{{- end -}}
{{- end -}}

{{/*
What the operator does to the objects of a TrainingJob, in the namespaces it watches:
reads and patches TrainingJobs (finalizer, kopf's progress annotations, status), deletes them after
runPolicy.ttlSecondsAfterFinished; creates and deletes the children (pods, headless Services, the managed
Redis password Secret, the job-config ConfigMap); reads pod status and the user's checkpoint PVCs and
external-Redis password Secrets; posts Events (kopf's and its own).
*/}}
{{- define "rlkube.workloadRules" -}}
- apiGroups: [rlkube.io]
  resources: [trainingjobs]
  verbs: [get, list, watch, patch, update, delete]
- apiGroups: [rlkube.io]
  resources: [trainingjobs/status]
  verbs: [get, patch, update]
- apiGroups: [rlkube.io]
  resources: [trainingjobs/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [pods, services, secrets, configmaps]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [pods/status]
  verbs: [get]
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, list, watch]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
# Kueue: the Workload of a queued TrainingJob (created, watched, marked Finished, admission released).
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, list, watch, create, patch]
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [get, patch, update]
{{- end -}}
