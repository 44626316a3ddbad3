"""rlkube: run PipelineRL-style LLM reinforcement learning jobs on Kubernetes.

Subpackages: `api` (the TrainingJob types and its CRD), `controller` (the kopf operator), `core` (the shared
training core that every pod runs) and `local` (runs one TrainingJob as local processes).
"""

__version__ = "0.1.0"
