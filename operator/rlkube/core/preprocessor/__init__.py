"""The preprocessor role (`python -m rlkube.core.preprocessor`): the actors' rollout groups -> the trainer's
training documents.

- `role`: the role process: reads the rollouts stream through one consumer group shared by every replica, writes
  each group's documents and acknowledges it atomically, credits the actors' lag counters for samples that became
  no document, holds while the trainer lags, stops on training_finished.
- `documents`: one rollout group -> its documents (pure): loss masks, log-probs, versions, advantages.
- `advantages`: the group-relative advantage estimators (leave-one-out, mean-std).

Kept free of imports so that `python -m rlkube.core.preprocessor` and the pure parts load only what they use.
"""
