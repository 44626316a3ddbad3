"""Completion rules of `rlkube local` (design.md s4), table-driven over the pure decide()."""

import pytest

from rlkube.local.outcome import Observation, decide

BASE = dict(now=100.0, max_steps=10, completion_timeout=30.0, event_timeout=60.0, last_event_at=95.0)


def obs(**kw):
    return Observation(**{**BASE, **kw})


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({}, None),  # running
        (dict(finished_at=99.0, finished_step=10, trainer_exit=0, trainer_exit_at=99.5), ("Succeeded", "TrainingFinished")),
        (dict(finished_at=99.0, finished_step=10), None),  # event, exit not yet: wait
        (dict(finished_at=60.0, finished_step=10, finished_checkpoint="/c/step-10"), ("Succeeded", "TrainingFinished")),
        (dict(finished_at=60.0, finished_step=10), ("Failed", "TrainerDidNotExit")),  # no checkpoint reported
        (dict(finished_at=99.0, finished_step=4, finished_interrupted=True, trainer_exit=0, trainer_exit_at=99.0),
         ("Failed", "TrainingInterrupted")),
        (dict(finished_at=99.0, finished_step=7, trainer_exit=0, trainer_exit_at=99.0), ("Failed", "TrainingInterrupted")),
        (dict(trainer_exit=0, trainer_exit_at=90.0), None),  # exit 0, event may still be read
        (dict(trainer_exit=0, trainer_exit_at=60.0), ("Failed", "TrainerExitedWithoutFinishedEvent")),
        (dict(trainer_exit=1, trainer_exit_at=99.0), ("Failed", "TrainerFailed")),
        (dict(crashed=("actor-0", -9)), ("Failed", "ComponentFailed")),
        (dict(last_event_at=10.0), ("Failed", "Stalled")),
        (dict(last_event_at=10.0, event_timeout=0), None),  # stall detection disabled
        (dict(interrupted_by_user=True), ("Failed", "Interrupted")),
    ],
)
def test_decide(kw, expected):
    out = decide(obs(**kw))
    assert (None if out is None else (out.phase, out.reason)) == expected
