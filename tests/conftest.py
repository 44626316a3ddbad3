"""Shared fixtures: REAL servers (redis-server, etcd + kube-apiserver + kube-controller-manager).

- `redis_server` (session): one redis-server on a free loopback port; `redis_client` flushes it per test.
- `cluster` (session): the kubeconfig of a real API server: $KUBECONFIG when it names a reachable cluster,
  else a control plane started here from the cached build (built on first use).
- `crd` (session): the TrainingJob CRD applied through the API and Established.
- `namespace`: a fresh namespace per test, deleted afterwards.
- `wheel` (session): a wheel of this repository, built offline as `pip install .` builds it.
Every server process started here is checked at session end; one still alive fails the run.
RLKUBE_TEST_CPU=path.jsonl records each test's wall and CPU time (tests/support/cpu_timing.py).
"""

from __future__ import annotations

import os

# Before torch is imported anywhere: on 2 cores oversubscribed threads make torch 3-7x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, settings

# Property tests check what is drawn, not how fast: on a loaded 2-core machine a draw can take seconds, and
# hypothesis's per-example deadline and its too_slow health check then fail a correct test.
settings.register_profile("rlkube", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("rlkube")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from cluster import node  # noqa: E402
from cluster.control_plane import ControlPlane  # noqa: E402
from cluster.tracked import STARTED_PIDS, track  # noqa: E402

from rlkube.local.redis_server import RedisServer  # noqa: E402

from support import cpu_timing  # noqa: E402


def pytest_configure(config):
    cpu_timing.register(config)


# `make test` runs two pytest-xdist workers (`-n 2`) with the scheduler below: each group of tests runs whole on one
# worker, groups in collection order. The tests that share one thing of this machine are one group, run one after
# another as in a serial run: the e2e tier (one real node per session, holding the machine's image store, its
# kube-proxy and the CNI bridge; the node agent), the real kubelets of tests/integration (test_real_kubelet*.py:
# a node owns /var/log/pods, the CNI bridge and its iptables rules while it runs pods), and every vLLM test (its
# CPU engine holds several GiB: two at once would crowd this 24 GiB machine). Every other module is a group of its
# own, so a module's servers and jobs start once. The rest is per test: free ports, temporary directories,
# namespaces, Redis key prefixes. xdist's own `--dist loadgroup` cannot carry this: it appends the group to
# `item._nodeid`, which pytest 9 no longer reads, so its groups fall apart into single tests.
SERIAL_GROUP = "machine"
SERIAL_MODULES = {"test_bench_inference.py"}


def xdist_group_of(nodeid: str) -> str:
    """The group of a test, from its id alone (the scheduler runs in xdist's controller, which holds ids only)."""
    path, _, rest = nodeid.partition("::")
    name = path.rsplit("/", 1)[-1]
    if (path.startswith("tests/e2e/") or name in SERIAL_MODULES or name.startswith("test_real_kubelet")
            or "vllm" in name or rest.endswith("[vllm]")):
        return SERIAL_GROUP
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class MachineGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    return MachineGroups(config, log)


def pytest_collection_modifyitems(items):
    for item in items:
        # The tier marker follows the directory, so `-m unit` etc. select by tier without decorating every test.
        parts = Path(str(item.fspath)).parts
        for tier in ("unit", "integration", "e2e"):
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
        if _starts_a_node(item) and xdist_group_of(item.nodeid) != SERIAL_GROUP:
            # Two nodes running pods at once take each other's pod log directories and bridge (CI once failed so).
            pytest.exit(f"{item.nodeid} starts a kubelet (tests/cluster/node.py) but its id does not put it in the "
                        f"{SERIAL_GROUP!r} group of tests/conftest.py (name its module test_real_kubelet*.py)",
                        returncode=pytest.ExitCode.USAGE_ERROR)
        if item.get_closest_marker("vllm") and xdist_group_of(item.nodeid) != SERIAL_GROUP:
            pytest.exit(f"{item.nodeid} needs vLLM but its id does not put it in the {SERIAL_GROUP!r} group of "
                        "tests/conftest.py (name its module test_*vllm*.py or add it to SERIAL_MODULES)",
                        returncode=pytest.ExitCode.USAGE_ERROR)


def _starts_a_node(item) -> bool:
    """The test's module holds tests/cluster/node.py's Node or `running`: it starts a real kubelet."""
    module = getattr(item, "module", None)
    return module is not None and any(v is node.Node or v is node.running for v in vars(module).values())


def pytest_sessionfinish(session, exitstatus):
    alive = []
    for name, pid in STARTED_PIDS:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{name} (pid {pid})")
        except psutil.NoSuchProcess:
            pass
    if alive:
        print(f"\nLEFTOVER server processes after the session: {', '.join(alive)}", file=sys.stderr)
        session.exitstatus = 1
    _FINAL_STATUS.append(int(session.exitstatus))


_FINAL_STATUS: list[int] = []


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Exit with the session's status once pytest has reported everything, skipping interpreter finalization.
    A session that ran the e2e tier aborted there now and then (SIGABRT after the summary, one thread left and no
    Python frame: 2 of 4 runs of tests/e2e/node_agent/test_chaos.py -k data_parallel_rank, never under gdb), which would
    turn a green run into exit 134. Nothing of the tests runs after this point; the cause is still to be found."""
    if _FINAL_STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_FINAL_STATUS[-1])


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    track("redis-server", server.proc.pid)
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server):
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


def _reachable(kubeconfig: str) -> bool:
    from kubernetes import client, config

    try:
        api = config.new_client_from_config(config_file=kubeconfig)
        client.VersionApi(api).get_code(_request_timeout=5)
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Path of a kubeconfig for a real API server."""
    given = os.environ.get("KUBECONFIG")
    if given and _reachable(given):
        yield Path(given)
        return
    cp = ControlPlane(tmp_path_factory.mktemp("control-plane")).start()
    for name, proc in cp.procs.items():
        track(name, proc.pid)
    yield cp.kubeconfig
    cp.stop()


@pytest.fixture(scope="session")
def api_client(cluster):
    from kubernetes import config

    client = config.new_client_from_config(config_file=str(cluster))
    yield client
    client.close()


@pytest.fixture(scope="session")
def crd(api_client):
    """Apply the generated CRD and wait until the API server serves it."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    from rlkube.api.crd import crd as make_crd

    ext = client.ApiextensionsV1Api(api_client)
    body = make_crd()
    name = body["metadata"]["name"]
    try:
        ext.create_custom_resource_definition(body)
    except ApiException as exc:
        if exc.status != 409:
            raise
        current = ext.read_custom_resource_definition(name)
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
        ext.replace_custom_resource_definition(name, body)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        conds = ext.read_custom_resource_definition(name).status.conditions or []
        if any(c.type == "Established" and c.status == "True" for c in conds):
            break
        time.sleep(0.1)
    else:
        raise TimeoutError(f"CRD {name} not Established")
    # Established can precede discovery by a moment; wait until a list call succeeds.
    custom = client.CustomObjectsApi(api_client)
    while True:
        try:
            custom.list_cluster_custom_object("rlkube.io", "v1alpha1", "trainingjobs")
            break
        except ApiException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    return body


@pytest.fixture
def namespace(api_client):
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    name = f"t-{uuid.uuid4().hex[:10]}"
    core.create_namespace({"metadata": {"name": name, "labels": {"rlkube.io/test": "true"}}})
    yield name
    core.delete_namespace(name)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """A wheel of this repository, built offline (`pip wheel --no-deps`) the way `pip install .` builds it."""
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src") / "rlkube"
    # From a clean copy, so the editable install's build artefacts in the work tree don't leak in.
    junk = (".git", ".venv", ".venv-vllm", ".venv-mlflow", "*.egg-info", "__pycache__", "build", "dist", "runs", "out")
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*junk))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(out), str(src)],
        check=True, capture_output=True, text=True,
    )
    (whl,) = out.glob("rlkube-*.whl")
    return whl
