"""Reading what a job left for people: its rollout samples (`rlkube samples`) and its run report (`rlkube report`),
from a local run's output directory or, through the API server, from a job in a cluster."""
