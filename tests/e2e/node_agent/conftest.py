"""Fixtures of the test node agent (tests/nodeagent/, for what the real node cannot run here; its docstring says
what and why):
- `node_agent` (session): one agent process for the session. At the end it must stop cleanly and leave no
  container process behind;
- `namespace`, `operator`, `job`: a namespace it serves, an operator process, a job (tests/support/clusterjob.py).
"""

from __future__ import annotations

import uuid

import pytest
from nodeagent.harness import AgentProcess

AGENT_LABEL = "rlkube.io/node-agent"
SESSION_TOKEN = uuid.uuid4().hex[:12]


@pytest.fixture(scope="session")
def node_agent(cluster, tmp_path_factory):
    # Served namespaces carry this session's token: two sessions on one cluster never compete for pods.
    agent = AgentProcess(cluster, tmp_path_factory.mktemp("node-agent"),
                         namespace_selector=f"{AGENT_LABEL}={SESSION_TOKEN}").start()
    yield agent
    agent.stop_leaving_nothing()


@pytest.fixture
def namespace(namespace, api_client, node_agent):
    """The root fixture's fresh namespace, labelled for this session's node agent (other tiers' namespaces
    carry only rlkube.io/test, so the agent never competes with their own fake kubelets)."""
    from kubernetes import client

    client.CoreV1Api(api_client).patch_namespace(namespace, {"metadata": {"labels": {AGENT_LABEL: SESSION_TOKEN}}})
    return namespace


@pytest.fixture
def core_api(api_client):
    from kubernetes import client

    return client.CoreV1Api(api_client)


@pytest.fixture
def operator(cluster, crd, namespace, tmp_path):
    """`rlkube operator -n <namespace>` for one test (the chaos tests kill and restart it)."""
    from support.clusterjob import OperatorProcess

    op = OperatorProcess(cluster, namespace, tmp_path / "operator.log").start()
    yield op
    op.stop()


@pytest.fixture
def job(api_client, node_agent, namespace, operator):
    """A ClusterJob handle; at the end whatever is left of the job is deleted and must go away."""
    from support.clusterjob import ClusterJob

    j = ClusterJob(api_client, node_agent, namespace)
    yield j
    j.recorder.stop()
    if j.follower is not None:
        j.follower.stop()
    if j.name and j.get() is not None:
        # Deleted while its operator runs, so the finalizer is released and the namespace can go too.
        if not operator.alive():
            operator.start()
        j.delete()
        j.wait(lambda tj: tj is None, 120, "TrainingJob deleted after the test")
