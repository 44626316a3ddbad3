"""The shared training core: one package, one role per process (trainer, actor, preprocessor, inference).

The role modules and their training stack; the operator process imports none of them (what it shares with the
roles is rlkube.contract; tests/unit/test_layering.py).
"""
