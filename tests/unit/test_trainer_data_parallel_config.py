"""Configuration of the data-parallel trainer (spec.trainer.nodes > 1): the spec check naming its field, torchrun's
environment read with errors naming the variable, and the backends that refuse more than one node."""

from __future__ import annotations

import copy

import pytest

from rlkube.lifecycle.validation import SpecError, parse_spec
from rlkube.core.backends.torch_distributed import DEFAULT_COLLECTIVE_TIMEOUT_S, DistConfig
from rlkube.contract.runtime import ENV_COLLECTIVE_TIMEOUT
from rlkube.contract.context import RoleContext
from rlkube.core.trainer import build_role

SPEC = {
    "model": {"path": "builtin://tiny-llama", "maxSequenceLength": 16},
    "algorithm": {"maxSteps": 3, "samplesPerStep": 4},
    "inference": {"engine": "native"},
    "trainer": {"nodes": 2},
}
ENV = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "LOCAL_RANK": "0"}


def spec_with(nodes: int, samples: int, backend: str = "torch") -> dict:
    spec = copy.deepcopy(SPEC)
    spec["trainer"].update(nodes=nodes, backend=backend)
    spec["algorithm"]["samplesPerStep"] = samples
    return spec


def test_every_node_needs_a_share_of_each_step():
    with pytest.raises(SpecError) as err:
        parse_spec(spec_with(nodes=4, samples=3))
    assert [e.field for e in err.value.errors] == ["spec.algorithm.samplesPerStep"]
    assert "the trainer's ranks (4 = nodes x processes per node)" in str(err.value)
    assert parse_spec(spec_with(nodes=2, samples=7)).trainer.nodes == 2  # uneven shares (4 and 3) are fine
    assert parse_spec(spec_with(nodes=4, samples=4)).algorithm.samples_per_step == 4


def test_torchrun_env():
    cfg = DistConfig.from_env(ENV)
    assert (cfg.rank, cfg.world_size, cfg.master_addr, cfg.master_port, cfg.local_rank) == (1, 2, "10.0.0.1",
                                                                                             29400, 0)
    assert cfg.timeout_s == DEFAULT_COLLECTIVE_TIMEOUT_S == 120.0
    assert DistConfig.from_env({**ENV, ENV_COLLECTIVE_TIMEOUT: "7.5"}).timeout_s == 7.5


@pytest.mark.parametrize(("change", "named"), [
    ({"RANK": None}, "RANK is not set"),
    ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT='http' is not a number"),
    ({"RANK": "2"}, "RANK=2 is outside WORLD_SIZE=2"),
    ({ENV_COLLECTIVE_TIMEOUT: "0"}, f"{ENV_COLLECTIVE_TIMEOUT}=0.0 must be > 0"),
    ({ENV_COLLECTIVE_TIMEOUT: "soon"}, f"{ENV_COLLECTIVE_TIMEOUT}='soon' is not a number"),
])
def test_bad_torchrun_env_names_the_variable(change, named):
    env = {k: v for k, v in {**ENV, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=named):
        DistConfig.from_env(env)


def _ctx(spec: dict) -> RoleContext:
    return RoleContext(namespace="ns", job="j", spec=parse_spec(spec), redis_url="redis://127.0.0.1:1/0")


def test_processes_per_node_multiply_the_ranks():
    spec = spec_with(nodes=2, samples=3)
    spec["trainer"]["processesPerNode"] = 2
    with pytest.raises(SpecError, match=r"the trainer's ranks \(4 = nodes x processes per node\)"):
        parse_spec(spec)
    spec["algorithm"]["samplesPerStep"] = 4
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2 but the spec has 4 trainer ranks"):
        build_role(_ctx(spec), client=None, env=ENV)


def test_world_size_must_match_the_spec():
    with pytest.raises(ValueError, match=r"WORLD_SIZE=3 but the spec has 2 trainer ranks"):
        build_role(_ctx(spec_with(nodes=2, samples=4)), client=None, env={**ENV, "WORLD_SIZE": "3"})


def test_fsdp_sharding_is_for_the_torch_backend_over_several_ranks_sharing_a_checkpoint_claim():
    spec = spec_with(nodes=2, samples=4)
    spec["trainer"]["sharding"] = "fsdp"
    spec["trainer"]["checkpoint"] = {"claimName": "shared"}
    assert parse_spec(spec).trainer.sharding == "fsdp"
    assert parse_spec(spec_with(nodes=2, samples=4)).trainer.sharding == "none"  # default: today's replicas

    def fields(change) -> list[str]:
        bad = copy.deepcopy(spec)
        change(bad["trainer"])
        with pytest.raises(SpecError) as err:
            parse_spec(bad)
        return [e.field for e in err.value.errors]

    assert fields(lambda t: t.update(backend="megatron")) == ["spec.trainer.sharding"]
    assert fields(lambda t: t.update(nodes=1)) == ["spec.trainer.sharding"]  # one rank: nothing to shard over
    assert fields(lambda t: t.pop("checkpoint")) == ["spec.trainer.checkpoint.claimName"]
    assert parse_spec({**spec, "trainer": {**spec["trainer"], "cpuOffload": True}}).trainer.cpu_offload
    assert fields(lambda t: t.update(sharding="none", cpuOffload=True)) == ["spec.trainer.cpuOffload"]
    one_pod = copy.deepcopy(spec)  # ranks of one pod share its checkpoint volume
    one_pod["trainer"].update(nodes=1, processesPerNode=2, checkpoint={})
    assert parse_spec(one_pod).trainer.sharding == "fsdp"


def test_megatron_tensor_parallel_divides_the_ranks_and_is_for_megatron():
    def tp_spec(tp: int, nodes: int = 2, processes: int = 2, backend: str = "megatron") -> dict:
        spec = spec_with(nodes=nodes, samples=4, backend=backend)
        spec["trainer"].update(processesPerNode=processes, megatron={"tensorParallel": tp})
        return spec

    def fields(spec) -> list[str]:
        with pytest.raises(SpecError) as err:
            parse_spec(spec)
        return [e.field for e in err.value.errors]

    assert parse_spec(tp_spec(2)).trainer.megatron.tensor_parallel == 2  # 4 ranks: TP 2 x DP 2
    assert parse_spec(tp_spec(4)).trainer.megatron.tensor_parallel == 4  # TP 4 x DP 1
    assert parse_spec(spec_with(nodes=1, samples=4)).trainer.megatron.tensor_parallel == 1  # the default
    assert fields(tp_spec(3)) == ["spec.trainer.megatron.tensorParallel"]
    with pytest.raises(SpecError, match=r"3 does not divide the trainer's 4 ranks"):
        parse_spec(tp_spec(3))
    assert fields(tp_spec(8)) == ["spec.trainer.megatron.tensorParallel"]
    assert fields(tp_spec(2, backend="torch")) == ["spec.trainer.megatron.tensorParallel"]
    assert fields(tp_spec(0)) == ["spec.trainer.megatron.tensorParallel"]  # ge=1
    # samplesPerStep is shared by the data-parallel replicas: 4 ranks at TP 4 are one replica
    one_replica = tp_spec(4)
    one_replica["algorithm"]["samplesPerStep"] = 1
    assert parse_spec(one_replica).algorithm.samples_per_step == 1
    two_replicas = tp_spec(2)
    two_replicas["algorithm"]["samplesPerStep"] = 1
    with pytest.raises(SpecError, match=r"data-parallel ranks \(2 = nodes x processes per node / tensorParallel\)"):
        parse_spec(two_replicas)
