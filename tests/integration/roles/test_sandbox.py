"""The code-execution sandbox (rlkube.core.actor.sandbox) with real child processes: the network refused by each layer
on its own (a listener the test opens sees no connection), a snippet that loops forever killed at its wall or CPU
limit, one that allocates past its memory limit failing cleanly, the empty environment and fresh cwd, and the
episode going on with the refusal as the tool's answer, counted."""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from support.local_cli import summary_of
import rlkube
from rlkube.core.actor.episodes import Limits, MessageEncoder, Reply, Turn, run_episode
from rlkube.core.hf.builtin import char_tokenizer
from rlkube.core.actor.sandbox import Sandbox, SandboxLimits, network_namespace_available

pytestmark = pytest.mark.integration

NETNS = network_namespace_available()
TOK = char_tokenizer()


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server
    server.close()


def connect_snippet(port: int) -> str:
    return (f"import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            f"s.sendall(b'hello')\n"
            f"print('connected')\n")


def no_connection(server: socket.socket) -> bool:
    """Nothing waits to be accepted (a completed handshake would be readable at once)."""
    return select.select([server], [], [], 0.2)[0] == []


@pytest.mark.parametrize("layers, refused_by", [
    (("netns", "audit"), "audit hook"),
    (("audit",), "audit hook"),
    pytest.param(("netns",), "network namespace", marks=pytest.mark.skipif(
        not NETNS, reason="this kernel refuses an unprivileged user namespace here")),
])
def test_a_tcp_connection_to_a_local_listener_is_refused_and_never_arrives(listener, layers, refused_by):
    port = listener.getsockname()[1]
    # The snippet's connection would succeed from this process: the listener is real and reachable.
    probe = socket.create_connection(("127.0.0.1", port), timeout=2)
    accepted, _ = listener.accept()
    accepted.close(), probe.close()

    result = Sandbox(SandboxLimits(timeout_s=10), layers=layers).run(connect_snippet(port))
    assert result.outcome == "refused", result
    assert result.refused_by == refused_by
    assert "connected" not in result.stdout
    assert f"refused by the {refused_by}" in result.message()
    assert no_connection(listener)
    assert set(layers) == set(result.layers) or (not NETNS and result.layers == ["audit"])


def test_the_network_namespace_is_up_where_the_kernel_allows_it():
    result = Sandbox().run("print('ok')")
    assert result.outcome == "ok" and result.stdout == "ok\n"
    assert ("netns" in result.layers) == NETNS and "audit" in result.layers


CAPS_SNIPPET = ("print({l.split(':')[0]: l.split()[1] for l in open('/proc/self/status') "
                "if l.startswith(('CapEff', 'CapPrm', 'CapInh', 'CapAmb', 'NoNewPrivs'))})")


@pytest.mark.skipif(not NETNS, reason="this kernel grants no unprivileged user + network namespace")
def test_a_snippet_in_its_network_namespace_holds_no_capability_and_can_gain_none():
    # The new user namespace grants every capability in it; under gVisor before 20260112 that exempts the snippet
    # from RLIMIT_NPROC (docs/guide/sandbox.md), so they are dropped at once.
    result = Sandbox(SandboxLimits(timeout_s=10), layers=("netns",)).run(CAPS_SNIPPET)
    assert result.outcome == "ok" and result.layers == ["netns"], result
    got = eval(result.stdout)  # noqa: S307 - a dict literal this test's snippet printed
    assert got == {"CapInh": "0" * 16, "CapPrm": "0" * 16, "CapEff": "0" * 16, "CapAmb": "0" * 16,
                   "NoNewPrivs": "1"}, got


def test_ctypes_and_new_processes_are_refused():
    for code, event in (("import ctypes; ctypes.CDLL(None).getpid()", "ctypes.dlopen"),
                        ("import subprocess; subprocess.run(['true'])", "subprocess.Popen"),
                        ("import os; os.system('true')", "os.system")):
        result = Sandbox().run(code)
        assert (result.outcome, result.refused_by, result.refused[:1]) == ("refused", "audit hook", [event]), code


def test_a_snippet_that_loops_forever_is_killed_at_its_wall_timeout():
    start = time.monotonic()
    result = Sandbox(SandboxLimits(timeout_s=1.0, cpu_s=60)).run("while True:\n    pass\n")
    took = time.monotonic() - start
    assert result.outcome == "timeout" and "over its wall time limit" in result.message()
    assert 1.0 <= took < 10, took


def test_a_snippet_that_loops_forever_is_killed_at_its_cpu_limit():
    result = Sandbox(SandboxLimits(timeout_s=60, cpu_s=1)).run("while True:\n    pass\n")
    assert result.outcome == "cpu" and result.seconds < 30, result


def test_a_snippet_allocating_past_its_memory_limit_fails_cleanly():
    result = Sandbox(SandboxLimits(memory_mb=128)).run("print('before')\nx = bytearray(512 * 2**20)\nprint('after')")
    assert result.outcome == "memory", result
    assert result.stdout == "before\n"
    assert "MemoryError" in result.stderr and "over its memory limit" in result.message()
    # Under the limit the same allocation works: the limit, not the machine, stopped it.
    assert Sandbox(SandboxLimits(memory_mb=1024)).run("x = bytearray(512 * 2**20)\nprint(len(x))").stdout \
        == f"{512 * 2 ** 20}\n"


def test_no_inherited_environment_and_a_fresh_working_directory_removed_afterwards(monkeypatch):
    monkeypatch.setenv("REDIS_PASSWORD", "secret")  # what a role's environment holds must not reach a snippet
    code = "import os, json\nprint(json.dumps([os.getcwd(), sorted(os.listdir('.')), sorted(os.environ)]))\n" \
           "open('left.txt', 'w').write('x')"
    first, second = Sandbox().run(code), Sandbox().run(code)
    (cwd1, files1, env1), (cwd2, files2, _) = json.loads(first.stdout), json.loads(second.stdout)
    assert cwd1 != cwd2 and files1 == files2 == []
    # The thread counts and the interpreter's own C.UTF-8 locale coercion; nothing of this process's environment.
    assert set(env1) <= {"LC_CTYPE", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}
    assert not os.path.exists(cwd1)


def test_output_past_its_limit_is_cut_and_said():
    result = Sandbox(SandboxLimits(output_bytes=4096)).run("print('x' * 100000)")
    assert result.outcome == "output" and len(result.stdout) <= 4096


def reply(prompt_ids: list[int]) -> Reply:
    """The model's turn, always "1" and its stop token (what it says does not matter to these tools)."""
    ids = [*TOK("1", add_special_tokens=False)["input_ids"], TOK.eos_token_id]
    return Reply(token_ids=ids, logprobs=[-0.5] * len(ids), version=0, finished=True, prompt_ids=list(prompt_ids))


async def sample(prompt_ids: list[int], max_tokens: int) -> Reply:
    return reply(prompt_ids)


def decode(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=True)


class CodeEpisodes:
    """Each reply calls the python tool on a fixed snippet (the network, then a forever loop, then a sum); the
    episode goes on with whatever the sandbox answered; a turn's reward is 1 when the tool printed something."""

    name = "code"

    def __init__(self, sandbox: Sandbox, snippets: list[str]):
        self.sandbox, self.snippets = sandbox, snippets
        self.answers: list[str] = []

    def start(self, prompt):
        env, turn = self, iter(self.snippets)

        class Episode:
            def respond(self, reply):
                code = next(turn, None)
                if code is None:
                    return None
                answer = env.sandbox.python_tool(code)
                env.answers.append(answer)
                return Turn([{"role": "tool", "content": answer}], reward=0.0 if "[sandbox]" in answer else 1.0)

            def reward(self):
                return 0.5

        return Episode()


def test_a_refused_or_killed_snippet_is_the_tool_s_answer_and_the_episode_goes_on_counted(listener):
    port = listener.getsockname()[1]
    env = CodeEpisodes(Sandbox(SandboxLimits(timeout_s=1.0)), [connect_snippet(port), "while True: pass",
                                                              "print(6 * 7)"])
    limits = Limits(max_turns=10, tool_timeout_s=5, sum_turn_rewards=True)
    result = asyncio.run(run_episode(env.start(None), reply(TOK("1+1=")["input_ids"]), sample,
                                     MessageEncoder(TOK, chat_template=False), decode, limits, 2))
    assert "refused by the audit hook (socket.getaddrinfo)" in env.answers[0] or \
        "refused by the audit hook (socket.__new__)" in env.answers[0], env.answers[0]
    assert "over its wall time limit" in env.answers[1] and env.answers[2] == "42"
    assert (result.turns, result.tool_calls) == (4, 3)
    assert (result.sandbox_refusals, result.tool_errors, result.tool_timeouts) == (1, 1, 1)
    assert result.turn_rewards == [0.0, 0.0, 1.0] and result.reward == 1.5  # summed with reward()'s 0.5
    assert no_connection(listener)


POD_UID = 10001  # the hardened pod's user (images/: runAsUser 10001, no capabilities)
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin")
DRIVER = """
import json, socket, sys, types
# The sandbox alone: its episode counter import pulls in the spec (pydantic), which this interpreter lacks.
sys.modules["rlkube.core.actor.episodes"] = types.SimpleNamespace(note_tool=lambda *names: None)
from rlkube.core.actor.sandbox import Sandbox, SandboxLimits
port = int(sys.argv[-1])
code = f"import socket\\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\\nprint('connected')"
out = {"uid": __import__("os").getuid(),
       "caps": [l for l in open("/proc/self/status") if l.startswith("CapEff")][0].split()[1]}
for layers in (("netns", "audit"), ("netns",), ("audit",)):
    r = Sandbox(SandboxLimits(timeout_s=10), layers=layers).run(code)
    out["+".join(layers)] = [r.outcome, r.refused_by, r.layers, r.stdout]
# A fork loop with no audit hook: RLIMIT_NPROC (16 tasks of this user) refuses the fork long before the wall limit.
fork = "import os\\nwhile True:\\n    os.fork()\\n"
r = Sandbox(SandboxLimits(timeout_s=20, processes=16), layers=("netns",)).run(fork)
out["fork"] = [r.outcome, r.seconds, r.stderr[-300:]]
print(json.dumps(out))
"""


@pytest.fixture
def pod_readable_package():
    """A copy of the rlkube package the pod's user can read, on PYTHONPATH for it: the checkout may be where uid 10001
    cannot read (a clone in a mode-700 home directory), and pytest's own tmp_path is private to root."""
    top = Path(tempfile.mkdtemp(prefix="rlkube-pod-user-"))
    try:
        shutil.copytree(Path(rlkube.__file__).resolve().parent, top / "rlkube",
                        ignore=shutil.ignore_patterns("__pycache__"))
        for path in [top, *top.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not SYSTEM_PYTHON,
                    reason="needs root, setpriv and /usr/bin/python3 to become the pod's unprivileged user")
def test_the_network_stays_refused_as_the_pod_s_unprivileged_user_without_capabilities(listener, pod_readable_package):
    operator_dir = pod_readable_package
    proc = subprocess.run(["setpriv", f"--reuid={POD_UID}", f"--regid={POD_UID}", "--clear-groups",
                           "--inh-caps=-all", "--bounding-set=-all", "env", "-i", f"PYTHONPATH={operator_dir}",
                           "TMPDIR=/tmp", SYSTEM_PYTHON, "-c", DRIVER, str(listener.getsockname()[1])],
                          capture_output=True, text=True, timeout=120, cwd="/tmp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = summary_of(proc.stdout)
    assert out["uid"] == POD_UID and int(out["caps"], 16) == 0
    netns = "netns" in out["netns+audit"][2]
    assert out["netns+audit"][:2] == ["refused", "audit hook"]
    assert out["audit"][:2] == ["refused", "audit hook"]
    # Without the hook the namespace refuses on its own where this kernel gives the user one; where it does not,
    # the result says the layer is missing (and the hook is what refuses).
    assert out["netns"][:2] == (["refused", "network namespace"] if netns else ["error", None]), out
    assert all("connected" not in v[3] for k, v in out.items() if "+" in k or k in ("netns", "audit"))
    assert no_connection(listener)
    # One status, from the snippet's own process, though every forked child raised too: the fork's error is the
    # answer, well inside the wall limit.
    outcome, seconds, stderr = out["fork"]
    assert outcome == "error" and "BlockingIOError" in stderr and seconds < 15, out["fork"]
