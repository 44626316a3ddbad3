"""The rlkube test node agent: runs the pods of a real kube-apiserver as local processes.

Test infrastructure, not shipped in the package. See agent.py for what it does and the files it writes,
worker.py for a pod's life, network.py for pod addresses, podinit.py for the in-pod launcher, and
harness.py for starting it from tests and `make demo-cluster`.

Whatever the real kubelet can run here runs on the real node instead (a kubelet on containerd with the operator
installed by its chart: tests/cluster/node.py, tests/support/realnode.py). This agent serves only what that node cannot:
- images it cannot have here: Fast-LLM (a CUDA build; the agent puts a stand-in `fast-llm` on PATH), the vLLM engine
  (test_vllm_job, test_fast_llm_job) and megatron-core (test_megatron_tp_job);
- an operator stopped and started at will (test_chaos): a process of the test's own, back faster than a pod starts;
- `make demo-cluster` (tests/support/demo_cluster.py): the tiny job through kube-apiserver without containerd or images.
Its own tests (tests/e2e/node_agent/test_nodeagent.py, tests/unit/test_nodeagent_rules.py) check the kubelet duties
those rely on: pod IPs and Service names, probes, restart policies, the kill sequence, volumes and claims, init
containers, scheduling by nodeSelector and extended resources.
"""
