"""The actor role (`python -m rlkube.core.actor`): prompts -> rollout groups, sampled from inference and scored.

- `role`: the role process: follows the trainer's events, reserves samples within the lag bound, samples groups
  (or reads sft reference completions), writes them to the rollouts stream; its jobs in `inference_client`
  (requests to the inference servers), `sampling_modes` (single-turn groups, episodes, sft reference rows) and
  `worker_loop` (reserve -> sample or read -> write).
- `lag`: the lag bound's counters in Redis, shared by every actor replica.
- `tasks`, `task_types`, `prompt_dataset`, `rewards`, `gym_tasks`: what is sampled and how it is scored
  (spec.task: built-in tasks, datasets, reasoning-gym, reward functions); `rlkube tasks` lists them.
- `episodes`, `environments`, `calculator`, `verifiers_env`, `sandbox`, `sandbox_child`: multi-turn episodes
  (spec.task.environment) and the sandbox their code-running tools use.
- `evaluation`: actor 0's scoring of held-out prompts (spec.evaluation).

Kept free of imports so that `python -m rlkube.core.actor`, `rlkube tasks` and the pure parts load only what they
use.
"""
