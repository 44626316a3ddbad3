"""The rlkube test node agent: runs the pods of a real kube-apiserver as local processes.

Test infrastructure, not shipped in the package. See agent.py for what it does and the files it writes,
worker.py for a pod's life, network.py for pod addresses, podinit.py for the in-pod launcher, and
harness.py for starting it from tests and `make demo-cluster`.

What the real kubelet shows for real (hardened security context, termination messages, crash-loop back-off,
restarts in place, grace periods, volumes, kube-scheduler's placement) runs on the real node instead: a kubelet on
containerd with the operator installed by its chart (tests/cluster/node.py, tests/e2e/realnode.py). Where the e2e
tests that ran here went:

Deleted, covered on the real node by tests/e2e/test_real_cluster.py:
- test_trainingjob's tiny-cpu (learns, Succeeds, tears down in order);
- test_chaos's trainer killed with -9, restarted in place, resuming from its checkpoint.
Moved to the real node (tests/e2e/test_real_node_*.py):
- test_failure_budgets: a crash-looping inference fails the job within componentBackoffLimit, in its own words
  (the kubelet's termination message, its back-off);
- test_chaos: a pod ignoring SIGTERM killed after its grace period; Redis killed mid-run; the actor killed and
  restarted in place; the job deleted mid-run, every container stopped in teardown order; a trainer pod recreated
  (restartPolicy Never) resuming from its claim, or failing CheckpointLost on an emptyDir; a data-parallel rank
  killed, both ranks restarted in place together (test_real_node_restarts);
- test_trainingjob's trainer.nodes 2 (with smaller CPU requests: two trainers at tiny-cpu's 1 CPU each do not fit
  the node's 2 CPUs beside inference; on CPU the trainers' spread is only a preference);
- test_fsdp_job: examples/tiny-cpu-fsdp.yaml on two trainer pods, both ranks writing their shards to one claim (a
  hostPath PersistentVolume), learning (test_real_node_pods).
- test_episodes_job (examples/calculator-cpu.yaml, tools and evaluation) and test_hf_model_job (a Qwen2 BPE model
  and its dataset, now on claims the real node mounts from hostPath PersistentVolumes) (test_real_node_tasks).
- test_pod_overrides: every role's template (env, a ConfigMap volume, a nodeSelector kube-scheduler holds until
  the Node is labelled), seen from a shell inside each container; two ranks in one trainer pod
  (test_real_node_pods).
- test_bad_inputs: models and datasets that cannot work fail their jobs from the init container or the actor in the
  kubelet's termination message, now with a config.json that uid 10001 cannot read; an hf:// model offline from a
  pre-filled cache claim (test_real_node_bad_inputs).

What this agent still serves, and why:
- Images the real node cannot have here: Fast-LLM (test_fast_llm_job: its image is a CUDA build that does not
  install here; the agent puts a stand-in `fast-llm` on PATH), vLLM (test_vllm_job, and the vllm engine of
  test_fast_llm_job: until the vLLM CPU image's real-node tier replaces them), megatron-core
  (test_megatron_tp_job: images/trainer-megatron is not among the images the real node imports).
- The operator stopped and started at will (test_chaos: killed mid-run and again within the seconds of a
  teardown; away while training finishes): an operator process of the test's own, back faster than a pod starts.
- Its own tests (tests/e2e/test_nodeagent.py, tests/unit/test_nodeagent_rules.py) check the kubelet duties those
  rely on: pod IPs and Service names, probes, restart policies, the kill sequence, volumes and claims, init
  containers, scheduling by nodeSelector and extended resources.
- `make demo-cluster` (tests/e2e/demo_cluster.py): the tiny job through kube-apiserver and the operator without
  containerd or images.
Dropped with its last user: the Warning Event for a SIGKILL past the grace period (only the SIGTERM test read it).
"""
