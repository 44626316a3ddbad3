"""rlkube: run PipelineRL-style LLM reinforcement learning jobs on Kubernetes.

Subpackages, lowest floor first (tests/unit/test_layering.py): `api` (the TrainingJob types and its CRD),
`contract` (what launchers and roles agree on), `lifecycle` (what a job is, for both launchers), `core` (the
shared training core that every pod runs), `controller` (the kopf operator) and `local` (runs one TrainingJob as
local processes), `bench` on top.
"""

__version__ = "0.1.0"
