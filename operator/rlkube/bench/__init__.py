"""Benchmarks (`rlkube bench ...`) and the stand-ins they and the tests run: the fake kubelet and trainer.

The top floor of the package: modules here import the operator, the core and `rlkube local`, and nothing
shipped imports them (tests/unit/test_layering.py checks both directions), so the operator never carries
benchmark code and a benchmark never reaches into the repository's tests/.
"""
