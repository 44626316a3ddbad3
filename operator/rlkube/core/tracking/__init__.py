"""Experiment trackers (spec.tracking): the trainer's metrics, the evaluation results, the job's config and sample
tables sent to MLflow, Weights & Biases and TensorBoard (docs/design.md §11).

`Trackers` (fanout.py) is what the trainer holds: one background worker per configured sink (worker.py), so a
tracker that is slow, unreachable or refuses its key never fails or slows training; its first failure is reported
once (the trainer publishes it as a `tracker_failed` event) and the other sinks go on. One run per job, named after
it, resumed when the trainer restarts (run.py keeps its ids and the steps already logged in the checkpoint volume).
"""

from rlkube.core.tracking.fanout import Trackers, TrackerFailure, build_trackers

__all__ = ["Trackers", "TrackerFailure", "build_trackers"]
