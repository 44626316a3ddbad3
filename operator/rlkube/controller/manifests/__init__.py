"""The operator's lowest floor: the child manifests of a TrainingJob, built from its spec as plain dicts.

Pure: no I/O and no client library (tests/unit/test_layering.py); the decisions above choose which to create.
"""
