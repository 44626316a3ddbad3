"""What the launchers and the role processes agree on, importable by both without importing either.

The environment a role is started with and the job config file (`runtime`), the Redis keys and event payloads
(`protocol`) and their reading and writing (`streams`). The operator process imports this package and never a
role module (rlkube.core), whose training stack its image does not carry; the roles import it to read what the
launcher wrote. It imports only `rlkube.api` (tests/unit/test_layering.py draws the floors).
"""
