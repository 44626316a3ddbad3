"""What the reconcile loop reads and writes, without a cluster: pod summaries, status merge patches, times."""

from __future__ import annotations

from datetime import UTC, datetime

from rlkube.api.status import TrainingJobStatus
from rlkube.controller.reconcile.job_io import merge_patch, parse_status, without_empty_strings
from rlkube.controller.decisions.observed import pod_view
from rlkube.controller.decisions.times import fmt_time, parse_time, stream_id_key, stream_id_time


def _pod(**status) -> dict:
    return {
        "metadata": {
            "name": "tj-trainer-0",
            "uid": "u1",
            "labels": {"rlkube.io/role": "trainer", "rlkube.io/index": "0", "rlkube.io/job-name": "tj"},
        },
        "status": status,
    }


def test_pod_view_of_a_running_ready_pod():
    view = pod_view(_pod(
        phase="Running", podIP="10.1.2.3",
        conditions=[{"type": "Ready", "status": "True"}],
        containerStatuses=[{"name": "trainer", "restartCount": 2,
                            "state": {"running": {"startedAt": "2025-01-01T00:00:05Z"}},
                            "lastState": {"terminated": {"exitCode": 1}}}],
    ))
    assert (view.role, view.index, view.phase, view.ready, view.restart_count) == ("trainer", 0, "Running", True, 2)
    assert view.exit_code is None and view.pod_ip == "10.1.2.3"
    assert view.started_at == datetime(2025, 1, 1, 0, 0, 5, tzinfo=UTC)
    assert view.running and not view.terminated


def test_pod_view_of_a_terminated_and_of_a_deleting_pod():
    done = pod_view(_pod(phase="Failed", containerStatuses=[
        {"name": "trainer", "restartCount": 0,
         "state": {"terminated": {"exitCode": 137, "startedAt": "2025-01-01T00:00:00Z",
                                  "finishedAt": "2025-01-01T00:01:00Z"}}}]))
    assert done.exit_code == 137 and done.terminated and not done.running
    assert done.finished_at == datetime(2025, 1, 1, 0, 1, tzinfo=UTC)
    raw = _pod(phase="Pending", containerStatuses=[{"name": "trainer", "state": {"waiting": {"reason": "ErrImagePull"}}}])
    raw["metadata"].update(deletionTimestamp="2025-01-01T00:02:00Z", deletionGracePeriodSeconds=0)
    gone = pod_view(raw)
    assert gone.deleting and gone.deletion_grace == 0 and gone.waiting_reason == "ErrImagePull"


def test_pod_view_of_an_init_container_waiting_on_its_image_pull():
    """While the model init container waits on its pull, the role's container only says PodInitializing: the
    init container's reason and message are the pod's (controller/decisions/image_pull.py reads them)."""
    raw = _pod(
        phase="Pending",
        initContainerStatuses=[{"name": "model", "restartCount": 0, "state": {"waiting": {
            "reason": "ImagePullBackOff", "message": 'Back-off pulling image "localhost/rlkube/core:nope"'}}}],
        containerStatuses=[{"name": "trainer", "restartCount": 0, "state": {"waiting": {"reason": "PodInitializing"}}}],
    )
    view = pod_view(raw)
    assert view.waiting_reason == "Init:ImagePullBackOff" and "localhost/rlkube/core:nope" in view.waiting_message
    assert view.restart_count == 0 and view.exit_code is None
    # An init container that runs (the model fetch) leaves the role's PodInitializing as it is.
    raw["status"]["initContainerStatuses"][0]["state"] = {"running": {"startedAt": "2025-01-01T00:00:09Z"}}
    assert pod_view(raw).waiting_reason == "PodInitializing"


def test_pods_without_our_labels_are_not_ours():
    raw = _pod(phase="Running")
    raw["metadata"]["labels"] = {"app": "other"}
    assert pod_view(raw) is None


def test_merge_patch_sends_only_changes_and_nulls_for_removed_fields():
    old = {"phase": "Running", "trainer": {"step": 3, "lastEventId": "1-0"}, "conditions": [{"type": "A"}]}
    new = {"phase": "Running", "trainer": {"step": 4}, "conditions": [{"type": "A"}, {"type": "B"}]}
    assert merge_patch(old, new) == {"trainer": {"step": 4, "lastEventId": None},
                                     "conditions": [{"type": "A"}, {"type": "B"}]}
    assert merge_patch(new, new) == {}


def test_status_documents_have_no_empty_strings():
    doc = TrainingJobStatus(message="").model_dump(by_alias=True, mode="json", exclude_none=True)
    assert "message" in doc and "message" not in without_empty_strings(doc)
    assert without_empty_strings({"c": [{"message": "", "type": "X"}]}) == {"c": [{"type": "X"}]}


def test_stored_status_with_foreign_fields_is_read():
    status = parse_status({"phase": "Running", "kopf": {"progress": {}}, "trainer": {"step": 7}})
    assert status.phase == "Running" and status.trainer.step == 7
    assert parse_status(None) == TrainingJobStatus()


def test_times_and_stream_ids():
    t = datetime(2025, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)
    assert fmt_time(t) == "2025-01-01T12:00:00.123Z"
    assert parse_time(fmt_time(t)) == t.replace(microsecond=123000)
    assert stream_id_time("1735732800123-4") == datetime(2025, 1, 1, 12, 0, 0, 123000, tzinfo=UTC)
    assert stream_id_key("10-2") > stream_id_key("9-9") > stream_id_key(None)
