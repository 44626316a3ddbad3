"""The operator's second floor: what it observes and what it does about it, as pure functions over plain values.

One reconcile pass (recipe.py and its steps), the teardown, Kueue and image-pull rules return actions; the I/O
above applies them. No I/O and no client library (tests/unit/test_layering.py); they import only the manifests below.
"""
