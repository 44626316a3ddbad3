"""Fixtures for the e2e tier: the test node agent runs every pod of the test namespaces.

`node_agent` (session): one agent process for the session (see tests/nodeagent/). At the end it must stop
cleanly and leave no container process behind.
"""

from __future__ import annotations

import pytest

from nodeagent.harness import AgentProcess


@pytest.fixture(scope="session")
def node_agent(cluster, tmp_path_factory):
    agent = AgentProcess(cluster, tmp_path_factory.mktemp("node-agent")).start()
    yield agent
    agent.stop()
    left = agent.live_processes()
    assert not left, f"container processes left after the node agent stopped: {[p.pid for p in left]}"


@pytest.fixture
def core_api(api_client):
    from kubernetes import client

    return client.CoreV1Api(api_client)
