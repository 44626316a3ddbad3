"""Fixtures for the e2e tier, on two kinds of node.

The real node (tests/e2e/realnode.py), shared by every module that runs on it:
- `real_node` (session): a control plane and a kubelet on containerd with kube-proxy and the cluster DNS, the
  project's images imported; at the end nothing of it is left;
- `real_api` (session): an API client for it; `chart_operator` (session): charts/rlkube installed, its operator
  pod Running and leading; `real_job`: a job handle in a fresh namespace, deleted afterwards.

The test node agent (tests/nodeagent/, for what the real node cannot run here; see its docstring):
- `node_agent` (session): one agent process for the session. At the end it must stop cleanly and leave no
  container process behind; `namespace`, `operator`, `job`: a namespace it serves, an operator process, a job.
"""

from __future__ import annotations

import uuid

import pytest
from nodeagent.harness import AgentProcess
from waiting import wait_for

AGENT_LABEL = "rlkube.io/node-agent"


@pytest.fixture(scope="session")
def real_node(tmp_path_factory):
    from realnode import real_cluster

    with real_cluster(tmp_path_factory.mktemp("real-cluster")) as n:
        yield n


@pytest.fixture(scope="session")
def real_api(real_node):
    from kubernetes import config

    api = config.new_client_from_config(config_file=str(real_node.cp.kubeconfig))
    yield api
    api.close()


@pytest.fixture(scope="session")
def chart_operator(real_node, real_api):
    """charts/rlkube installed with the Helm SDK; the operator pod (V1Pod) once Running, Ready and leading, as
    first installed (a chaos test replaces it: realnode.operator_pod reads the current one)."""
    from realnode import install_operator

    return install_operator(real_node, real_api)


@pytest.fixture
def real_job(real_node, real_api, chart_operator):
    """A realnode.RealJob in a fresh namespace of the real node, once the chart's webhook answers there (the first
    test of a module run alone came right after the operator pod was Ready, and its apply was refused with
    "failed calling webhook"); at the end the job is deleted (its operator releases the finalizer), then the
    namespace."""
    from clusterjob import example
    from kubernetes import client
    from realnode import RealJob, create_namespace, webhook_serving

    core = client.CoreV1Api(real_api)
    ns = f"e2e-{uuid.uuid4().hex[:6]}"
    create_namespace(core, ns)
    webhook_serving(real_api, ns, example(), real_node)
    j = RealJob(real_api, real_node, ns)
    yield j
    j.close()
    if j.name and j.get() is not None:
        j.custom.delete_namespaced_custom_object("rlkube.io", "v1alpha1", ns, "trainingjobs", j.name)
        wait_for(lambda: j.get() is None, 120, "the TrainingJob deleted after the test")
    core.delete_namespace(ns)


SESSION_TOKEN = uuid.uuid4().hex[:12]


@pytest.fixture(scope="session")
def node_agent(cluster, tmp_path_factory):
    # Served namespaces carry this session's token: two sessions on one cluster never compete for pods.
    agent = AgentProcess(cluster, tmp_path_factory.mktemp("node-agent"),
                         namespace_selector=f"{AGENT_LABEL}={SESSION_TOKEN}").start()
    yield agent
    agent.stop()
    left = agent.live_processes()
    assert not left, f"container processes left after the node agent stopped: {[p.pid for p in left]}"


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
    from clusterjob import OperatorProcess

    op = OperatorProcess(cluster, namespace, tmp_path / "operator.log").start()
    yield op
    op.stop()


@pytest.fixture
def job(api_client, node_agent, namespace, operator):
    """A ClusterJob handle; at the end whatever is left of the job is deleted and must go away."""
    from clusterjob import ClusterJob

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
