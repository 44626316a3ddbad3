"""tests/xdist_groups.py: the groups for pytest-xdist: the tests that share one thing of this machine run on one worker,
one after another; every other module is a group of its own."""

from __future__ import annotations

import pytest
from xdist_groups import REAL_NODE_GROUP, VLLM_GROUP, xdist_group_of


@pytest.mark.parametrize(("nodeid", "group"), [
    ("tests/e2e/test_real_cluster.py::test_x", REAL_NODE_GROUP),
    ("tests/e2e/test_real_node_pods.py::test_x[a]", REAL_NODE_GROUP),
    ("tests/integration/test_real_kubelet.py::test_x", REAL_NODE_GROUP),
    ("tests/e2e/test_vllm_image.py::test_x", REAL_NODE_GROUP),  # vLLM in a pod of the real node
    ("tests/e2e/test_vllm_job.py::test_x", VLLM_GROUP),
    ("tests/e2e/test_chaos.py::test_x", VLLM_GROUP),  # the node agent's modules: one agent per session
    ("tests/integration/test_bench_inference.py::test_x", VLLM_GROUP),
    ("tests/integration/test_lora_vllm.py::test_x", VLLM_GROUP),
    ("tests/integration/test_actor_episodes.py::test_x[vllm]", VLLM_GROUP),
    ("tests/integration/test_actor_episodes.py::test_x[native]", "tests/integration/test_actor_episodes.py"),
    ("tests/unit/test_roles.py::test_x", "tests/unit/test_roles.py"),
])
def test_a_test_id_names_its_group(nodeid, group):
    assert xdist_group_of(nodeid) == group


def test_every_collected_test_of_the_two_machine_groups_is_e2e_vllm_or_real(request):
    """The groups hold what they say, over this session's own collection."""
    for item in request.session.items:
        group = xdist_group_of(item.nodeid)
        if group == VLLM_GROUP:
            assert (item.nodeid.startswith("tests/e2e/") or item.get_closest_marker("vllm")
                    or "vllm" in item.nodeid or "bench_inference" in item.nodeid), item.nodeid
        elif group == REAL_NODE_GROUP:
            assert "test_real_" in item.nodeid or "test_vllm_image" in item.nodeid, item.nodeid
