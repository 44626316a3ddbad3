"""engine: vllm without vLLM: the engine arguments rlkube derives from spec.inference.vllm, the spec block itself,
and what the role says when no interpreter with vllm is at hand. (Serving is
tests/integration/inference/test_vllm_server.py.)
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError
from rlkube.lifecycle.validation import parse_spec
from rlkube.core.inference.vllm_engine import ENV_VLLM_PYTHON, engine_cli_args
from rlkube.core.inference.vllm_worker import EXTENSION

pytestmark = pytest.mark.unit


def spec(**vllm):
    return parse_spec({
        "model": {"path": "builtin://tiny-llama", "seed": 2, "maxSequenceLength": 48, "dtype": "float32"},
        "task": {"name": "reverse-digits"},
        "algorithm": {"maxSteps": 2},
        "inference": {"engine": "vllm", **({"vllm": vllm} if vllm else {})},
    })


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_cpu_defaults_fit_a_shared_machine():
    args = engine_cli_args(spec(), "/models/m", index=1)
    assert option(args, "--model") == "/models/m"
    assert option(args, "--served-model-name") == "builtin://tiny-llama"  # what the actor's requests name
    assert option(args, "--max-model-len") == "48"
    assert option(args, "--gpu-memory-utilization") == "0.1"
    assert option(args, "--dtype") == "float32"
    assert option(args, "--seed") == "2001"  # per replica, as the native engine seeds
    assert option(args, "--worker-extension-cls") == EXTENSION
    assert option(args, "--logprobs-mode") == "processed_logprobs"
    assert "--enforce-eager" in args


def test_gpu_defaults_and_spec_knobs():
    args = engine_cli_args(spec(), "/m", gpus=True)
    assert option(args, "--gpu-memory-utilization") == "0.9" and "--no-enforce-eager" in args
    args = engine_cli_args(spec(maxModelLength=4096, memoryFraction=0.5, enforceEager=True,
                                extraEngineArgs=["--max-num-seqs=8", "--seed", "9"]), "/m", gpus=True)
    assert option(args, "--max-model-len") == "4096"
    assert option(args, "--gpu-memory-utilization") == "0.5" and "--enforce-eager" in args
    assert args[-3:] == ["--max-num-seqs=8", "--seed", "9"]  # last, so they override ours (argparse: last wins)


@pytest.mark.parametrize("bad", [{"memoryFraction": 0}, {"memoryFraction": 1.5}, {"maxModelLength": 4},
                                 {"extraEngineArgs": "--x"}, {"gpuMemoryUtilization": 0.5}])
def test_bad_vllm_block_is_refused_with_its_path(bad):
    with pytest.raises((ValidationError, ValueError)) as err:
        spec(**bad)
    assert "vllm" in str(err.value)


def test_the_worker_extension_is_importable_by_name():
    module, _, cls = EXTENSION.rpartition(".")
    out = subprocess.run([sys.executable, "-c", f"import {module} as m; print(m.{cls}.__name__)"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == cls, out.stderr


def test_without_vllm_the_role_exits_with_the_reason(tmp_path, monkeypatch):
    """The main venv has no vllm: with no RLKUBE_VLLM_PYTHON the role says how to get one, and a
    RLKUBE_VLLM_PYTHON without vllm (here: this same interpreter) is not re-executed twice."""
    pytest.importorskip("torch")
    from importlib.util import find_spec

    if find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    from rlkube.core.inference import vllm_engine

    with pytest.raises(SystemExit) as err:
        vllm_engine.reexec_with_vllm_python({ENV_VLLM_PYTHON: ""})
    assert "vllm is not installed" in str(err.value) and ENV_VLLM_PYTHON in str(err.value)
    with pytest.raises(SystemExit) as err:
        vllm_engine.reexec_with_vllm_python({ENV_VLLM_PYTHON: sys.executable, "RLKUBE_VLLM_REEXECUTED": "1"})
    assert "has no vllm either" in str(err.value)
    with pytest.raises(SystemExit) as err:
        vllm_engine.reexec_with_vllm_python({ENV_VLLM_PYTHON: str(tmp_path / "missing-python")})
    assert "is not executable" in str(err.value)


def test_update_progress_attributes_each_choices_tokens_to_the_weights_that_sampled_them():
    import asyncio

    from rlkube.core.inference.vllm_engine import VllmEngine, _Versions

    async def scenario():
        engine = VllmEngine(llm=None, served=None, loop=asyncio.get_running_loop())
        a, b, c = (f"cmpl-{x * 32}" for x in "abc")
        engine._running = {a: _Versions([[[0, 0]], [[0, 0]]], [False, False]),  # n=2: running, finished
                           b: _Versions([[[0, 0]]], [False]),  # not scheduled before the update
                           c: _Versions([[[0, 0]]], [False])}  # running at the update, then more tokens
        await engine.begin_update()
        assert not engine._settled.is_set()
        await engine.end_update(1, {"running": {f"0_{a}-1234abcd": 3, f"{c}-00000000": 0, "junk": 1},
                                    "finished": [f"1_{a}-1234abcd"]})
        assert engine._settled.is_set() and engine.version == 1
        assert engine._running[a].spans == [[[0, 0], [3, 1]], [[0, 0]]]
        assert engine._running[b].spans == [[[0, 1]]]
        assert engine._running[c].spans == [[[0, 1]]]
        await engine.end_update(2, {"running": {f"0_{a}-1234abcd": 5}, "finished": []})
        assert engine._running[a].spans == [[[0, 0], [3, 1], [5, 2]], [[0, 0]]]  # the finished choice stays
        assert engine._running[a].pieces(0, 2, 4) == [(0, 1, 0), (1, 3, 1), (3, 4, 2)]
        assert engine._running[a].pieces(0, 3, 0) == [(0, 0, 1)]
        await engine.end_update()  # a refused update changes nothing
        assert engine.version == 2 and engine._running[b].spans == [[[0, 2]]]

    asyncio.run(scenario())


def test_the_worker_remembers_the_requests_the_model_runner_finished():
    from rlkube.core.inference.vllm_worker import _FinishTracking

    requests = _FinishTracking({"x": 1, "y": 2})
    assert requests.pop("x", None) == 1 and requests.pop("absent", None) is None
    assert requests.take_finished() == ["x"] and requests.take_finished() == []
    assert dict(requests) == {"y": 2}


def test_tensor_parallel_workers_on_cpu_are_not_bound_to_numa_nodes_unless_asked():
    from rlkube.core.inference.vllm_engine import ENV_CPU_BIND, cpu_threads_binding

    tp2 = parse_spec({**spec().model_dump(by_alias=True, exclude_none=True),
                      "inference": {"engine": "vllm", "tensorParallel": 2}})
    assert option(engine_cli_args(tp2, "/m"), "--tensor-parallel-size") == "2"
    env: dict[str, str] = {}
    assert cpu_threads_binding(tp2, env, gpus=False) == "nobind" and env == {ENV_CPU_BIND: "nobind"}
    chosen = {ENV_CPU_BIND: "0|1"}
    assert cpu_threads_binding(tp2, chosen, gpus=False) is None and chosen == {ENV_CPU_BIND: "0|1"}
    for s, gpus in ((spec(), False), (tp2, True)):  # one worker; or GPUs, where no thread binding applies
        untouched: dict[str, str] = {}
        assert cpu_threads_binding(s, untouched, gpus=gpus) is None and untouched == {}
