"""The rlkube test node agent: runs the pods of a real kube-apiserver as local processes.

Test infrastructure, not shipped in the package. See agent.py for what it does and the files it writes,
worker.py for a pod's life, network.py for pod addresses, podinit.py for the in-pod launcher, and
harness.py for starting it from tests and `make demo-cluster`.
"""
