"""The groups tests/conftest.py's pytest-xdist scheduler runs whole on one worker each.

`make test` runs pytest-xdist workers (`-n 3` on this 2-core machine: the tests that wait on a kubelet, a vLLM engine
or a job leave CPU a third worker uses) with the scheduler of tests/conftest.py: each group of tests runs whole on one worker,
groups in collection order. The tests that share one thing of this machine are one group, run one after another
as in a serial run:
- REAL_NODE_GROUP: the modules on the real node (tests/e2e/test_real_*.py, test_vllm_image.py) and the real
  kubelet of tests/integration: one real node per machine (the image store, its kube-proxy, a machine-wide lock);
- VLLM_GROUP: every vLLM test (its CPU engine holds several GiB: two at once would crowd this 24 GiB machine) and
  the node agent's e2e modules (its vLLM and Fast-LLM jobs run vLLM under it; one agent per session).
The two groups run at once on two workers: their pod networks are apart (the agent's bridge takes a 10.200-254
/24 and names its namespaces rlk<id>-, the real node's CNI bridge a 10.88-95 /24 and cni- namespaces) and neither
reaches pods through the other's Services. Every other module is a group of its own, so a module's servers and
jobs start once. The rest is per test: free ports, temporary directories, namespaces, Redis key prefixes.
xdist's own `--dist loadgroup` cannot carry this: it appends the group to `item._nodeid`, which pytest 9 no longer
reads, so its groups fall apart into single tests.
"""

from __future__ import annotations

REAL_NODE_GROUP, VLLM_GROUP = "real-node", "vllm"
REAL_NODE_MODULES = {"test_real_kubelet.py", "test_vllm_image.py"}
VLLM_MODULES = {"test_bench_inference.py"}


def xdist_group_of(nodeid: str) -> str:
    """The group of a test, from its id alone (the scheduler runs in xdist's controller, which holds ids only)."""
    path, _, rest = nodeid.partition("::")
    name = path.rsplit("/", 1)[-1]
    if name.startswith("test_real_") or name in REAL_NODE_MODULES:
        return REAL_NODE_GROUP
    if path.startswith("tests/e2e/") or name in VLLM_MODULES or "vllm" in name or rest.endswith("[vllm]"):
        return VLLM_GROUP
    return path
