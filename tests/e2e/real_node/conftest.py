"""Fixtures of the real node (tests/support/realnode.py), shared by every module here:
- `real_node` (session): a control plane and a kubelet on containerd with kube-proxy and the cluster DNS, the
  project's images imported; at the end nothing of it is left;
- `real_api` (session): an API client for it; `chart_operator` (session): charts/rlkube installed, its operator
  pod Running and leading; `real_job`: a job handle in a fresh namespace, deleted afterwards.
"""

from __future__ import annotations

import uuid

import pytest
from support.waiting import wait_for


@pytest.fixture(scope="session")
def real_node(tmp_path_factory):
    from support.realnode import real_cluster

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
    from support.realnode import install_operator

    return install_operator(real_node, real_api)


@pytest.fixture
def real_job(real_node, real_api, chart_operator):
    """A realnode.RealJob in a fresh namespace of the real node, once the chart's webhook answers there (the first
    test of a module run alone came right after the operator pod was Ready, and its apply was refused with
    "failed calling webhook"); at the end the job is deleted (its operator releases the finalizer), then the
    namespace."""
    from kubernetes import client
    from support.clusterjob import example
    from support.realnode import RealJob, create_namespace, webhook_serving

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
