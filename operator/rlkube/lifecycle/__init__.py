"""What a TrainingJob IS, written once for both launchers (the operator and `rlkube local`).

Pure: no I/O, no clock (time is passed in), imports only `rlkube.api` and `rlkube.contract`; the roles in
`rlkube.core` never import it (they get the spec already validated, and the contract). The roles and their start gates and order (`roles`), the environment
a role process gets (`environment`), the checks of a spec beyond its schema (`validation`, with the pod rules
they share with the builders in `owned`), the phases, reasons and condition types (`phases`), and the judgement
of how a job ends (`judgement`, one module per policy under `policies/`, as JobSet keeps one file per policy). The operator turns these into pods and
status; `rlkube local` into processes and a summary line; a table test runs the same evidence through both.
"""
