# Fresh Debian machine with Python 3.11, root, package registries only:
#   make demo   runs a tiny TrainingJob end to end on this machine (no GPU, no cluster)
#   make test   runs every test tier against real Redis and a real kube-apiserver
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
# `make demo` needs only Redis; the tests also need etcd, the node agent's iproute2, and the Go toolchain and
# vendored-library replacements that build kube-apiserver.
APT_DEMO = redis-server
APT_PACKAGES = $(APT_DEMO) etcd-server golang-go rsync make dpkg-dev openssl iproute2 \
               golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
export DEBIAN_FRONTEND = noninteractive

.PHONY: demo test deps deps-apt deps-pip control-plane crd demo-cluster

demo:
	$(MAKE) deps-apt APT_PACKAGES="$(APT_DEMO)"
	$(MAKE) deps-pip
	$(PYTHON) -m rlkube.cli local examples/tiny-cpu.yaml

# The same job on a real kube-apiserver: the operator creates pods, the test node agent runs them (tests/nodeagent).
demo-cluster: deps control-plane
	$(PYTHON) tests/e2e/demo_cluster.py

test: deps control-plane
	$(PYTHON) -m pytest -ra

deps: deps-apt deps-pip

deps-apt:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "apt: installing$$missing"; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

deps-pip:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,megatron]'

control-plane:
	bash tests/cluster/build-control-plane.sh

crd:
	$(PYTHON) -m rlkube.cli crd > crds/rlkube.io_trainingjobs.yaml
	# The Helm chart ships the same file (tests/unit/test_chart.py fails when they differ).
	cp crds/rlkube.io_trainingjobs.yaml charts/rlkube/crds/rlkube.io_trainingjobs.yaml
