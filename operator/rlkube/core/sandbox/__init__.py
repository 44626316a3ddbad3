"""The sandbox role: an HTTP server that runs the snippets a job's actors send it (spec.sandbox.mode `pods`).

`server`: the aiohttp application and the role's main; `python -m rlkube.core.sandbox` runs it. Each snippet runs
with rlkube.core.actor.sandbox's runner (rlimits, a user + network namespace, the audit hook) in a fresh directory;
the pod around it adds what a process cannot give itself (docs/guide/sandbox.md).
"""
