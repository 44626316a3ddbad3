# Fresh Debian machine with Python 3.11, root, package registries only:
#   make demo   runs a tiny TrainingJob end to end on this machine (no GPU, no cluster)
#   make test   runs every test tier against real Redis and a real kube-apiserver
#   make bench  runs `rlkube bench operator` against the project's own control plane (BENCH_ARGS="-n 20 --json")
# pip installs into the project's virtual environment $(VENV) (created when missing), never the system interpreter.
SYSTEM_PYTHON ?= python3
VENV ?= .venv
PYTHON = $(VENV)/bin/python
PIP = $(PYTHON) -m pip
# Extras `deps-pip` installs: the training core, the test tools and the megatron test tier (`make demo`: core only).
EXTRAS ?= core,dev,megatron
BENCH_ARGS ?=
# `make demo` needs only Redis; the tests also need etcd, the node agent's iproute2, and the Go toolchain and
# vendored-library replacements that build kube-apiserver.
APT_DEMO = redis-server
APT_PACKAGES = $(APT_DEMO) etcd-server golang-go rsync make dpkg-dev openssl iproute2 \
               golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
export DEBIAN_FRONTEND = noninteractive

.PHONY: demo test bench deps deps-apt deps-pip venv control-plane crd demo-cluster

demo:
	$(MAKE) deps-apt APT_PACKAGES="$(APT_DEMO)"
	$(MAKE) deps-pip EXTRAS=core
	$(PYTHON) -m rlkube.cli local examples/tiny-cpu.yaml

# The same job on a real kube-apiserver: the operator creates pods, the test node agent runs them (tests/nodeagent).
demo-cluster: deps control-plane
	$(PYTHON) tests/e2e/demo_cluster.py

test: deps control-plane
	$(PYTHON) -m pytest -ra

# The control plane runs for the benchmark only: control_plane.py --run starts it, runs the command with its
# kubeconfig in place of {kubeconfig}, and stops it.
bench: deps control-plane
	$(PYTHON) tests/cluster/control_plane.py --run \
	  $(PYTHON) -m rlkube.cli bench operator --kubeconfig {kubeconfig} $(BENCH_ARGS)

deps: deps-apt deps-pip

deps-apt:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "apt: installing$$missing"; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

venv: $(PYTHON)

# A Debian python3 has no ensurepip (so no venv) without python3-venv.
$(PYTHON):
	@$(SYSTEM_PYTHON) -c 'import ensurepip' 2>/dev/null || $(MAKE) deps-apt APT_PACKAGES=python3-venv
	$(SYSTEM_PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch alone first: 2.13.0 is the CPU wheel on disk, and the extras' `torch==2.13.0` is then satisfied (resolved
# from them instead, any other torch pulls gigabytes of CUDA).
deps-pip: $(PYTHON)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[$(EXTRAS)]'

control-plane:
	bash tests/cluster/build-control-plane.sh

crd:
	$(PYTHON) -m rlkube.cli crd > crds/rlkube.io_trainingjobs.yaml
	# The Helm chart ships the same file (tests/unit/test_chart.py fails when they differ).
	cp crds/rlkube.io_trainingjobs.yaml charts/rlkube/crds/rlkube.io_trainingjobs.yaml
