"""spec.trainer.lora (docs/design.md §6): validation, the torch backend with a PEFT adapter, the adapter update's size
and wire marking, the engine's merge (base + scaling x B @ A) against PEFT's own merge, and the reference policy
as the base with the adapter disabled. Everything float32 on the built-in tiny model; the integration tests
(tests/integration/weights/test_lora_weight_updates.py, test_lora_local.py) cross the real weight-update group and
`rlkube local`."""

from __future__ import annotations

import copy

import pytest
import torch
from support.hf_models import builtin_dir, write_tiny_model
from rlkube.core.training import lora
from rlkube.core.errors import ConfigError
from rlkube.core.hf.loading import load_model
from rlkube.core.training.losses import token_logprobs
from rlkube.core.trainer import Trainer
from rlkube.core.weights.wire import ADAPTER, FULL, pack_weights, unpack_weights, update_nbytes
from rlkube.lifecycle.validation import SpecError, parse_spec
from support import specs

pytestmark = pytest.mark.unit

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def lora_spec(**overrides):
    return parse_spec(specs.spec(**{"trainer.lora": {"rank": 8, "alpha": 16, "targetModules": TARGETS},
                                    "inference.engine": "native", **overrides}))


def randomize_adapter(trainer: Trainer, seed: int = 0) -> None:
    """A trained-looking adapter (PEFT starts B at zero, which would make every comparison trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.backend.gradient_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize(("overrides", "says"), [
    ({"trainer.backend": "megatron"}, "backend torch, not megatron"),
    ({"trainer.backend": "fast-llm", "trainer.gpusPerNode": 1, "trainer.fastLlm.modelFormat": "llama",
      "model.path": "/models/m", "inference.engine": "vllm"}, "backend torch, not fast-llm"),
])
def test_lora_is_refused_where_it_is_not_built_naming_the_field(overrides, says):
    with pytest.raises(SpecError) as err:
        lora_spec(**overrides)
    fields = {e.field: e.message for e in err.value.errors}
    assert says in fields["spec.trainer.lora"], fields


def test_lora_with_fsdp_validates_and_its_reference_policy_is_still_refused():
    """LoRA under FSDP2 is built (rlkube.core.backends.fsdp_lora; tests/integration/roles/test_lora_fsdp.py); the KL
    term's reference is the unsharded backend's only, with or without LoRA."""
    spec = lora_spec(**{"trainer.sharding": "fsdp", "trainer.processesPerNode": 2})
    assert spec.trainer.sharding == "fsdp" and spec.trainer.lora.rank == 8
    with pytest.raises(SpecError) as err:
        lora_spec(**{"trainer.sharding": "fsdp", "trainer.processesPerNode": 2, "algorithm.klCoef": 0.1})
    assert {e.field for e in err.value.errors} == {"spec.algorithm.klCoef"}


def test_defaults_and_examples_validate():
    spec = parse_spec(specs.spec(**{"trainer.lora": {}}))
    assert (spec.trainer.lora.rank, spec.trainer.lora.alpha, spec.trainer.lora.dropout) == (8, 16.0, 0.0)
    assert "lm_head" not in spec.trainer.lora.target_modules  # decoder linears by default
    assert parse_spec(specs.spec()).trainer.lora is None  # absent: full-weight training


def test_only_the_adapter_trains_and_the_update_carries_it_alone():
    trainer = Trainer(lora_spec(), model_dir=builtin_dir())
    trained = trainer.backend.gradient_parameters()
    assert trained and all("lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert trainer.sends_adapter
    adapter = pack_weights(trainer.weight_update())
    full = pack_weights(trainer.backend.weights())
    assert adapter.meta["kind"] == ADAPTER and full.meta["kind"] == FULL
    assert adapter.meta["adapter"] == {"format": "peft-lora", "rank": 8, "alpha": 16.0, "scaling": 2.0,
                                       "target_modules": TARGETS}
    a_bytes, f_bytes = update_nbytes(adapter.meta), update_nbytes(full.meta)
    print(f"tiny-llama float32: adapter update {a_bytes} bytes, full weights {f_bytes} bytes "
          f"({a_bytes / f_bytes:.1%})")
    # rank 8 on 7 decoder linears x 2 layers + lm_head: 24,528 parameters of 138,816
    assert a_bytes == 4 * sum(p.numel() for p in trained) == 98_112
    assert f_bytes == 555_264 and a_bytes < f_bytes / 5
    # vLLM takes full weights: it gets base + adapter merged
    vllm = Trainer(lora_spec(**{"inference.engine": "vllm"}), model_dir=builtin_dir())
    assert not vllm.sends_adapter and pack_weights(vllm.weight_update()).meta["kind"] == FULL


def test_a_fresh_adapter_is_drawn_from_the_models_seed_and_leaves_the_process_rng_alone():
    """The same spec starts from the same adapter in every run and on every rank; another seed from another one;
    and the draw does not move the process's RNG (sampling and dropout draw from it)."""
    def fresh(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(1234)
        trainer = Trainer(lora_spec(**{"model.seed": seed}), model_dir=builtin_dir())
        after = torch.rand(4)
        torch.manual_seed(1234)
        assert torch.equal(after, torch.rand(4)), "wrapping the model drew from the process's RNG"
        return lora.adapter_state(trainer.model)

    first, again, other = fresh(3), fresh(3), fresh(4)
    a_names = [n for n in first if n.endswith(".lora_A.weight")]
    assert a_names and all(float(first[n].abs().max()) > 0 for n in a_names)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert all(not torch.equal(first[n], other[n]) for n in a_names)


def test_merged_weights_and_the_engine_merge_equal_peft_merge_and_unload():
    trainer = Trainer(lora_spec(), model_dir=builtin_dir())
    randomize_adapter(trainer)
    want = copy.deepcopy(trainer.model).merge_and_unload().state_dict()  # PEFT's own merge
    merged = dict(trainer.backend.weights())
    assert set(merged) == set(want)
    for name, w in merged.items():
        torch.testing.assert_close(w, want[name], rtol=0, atol=1e-6, msg=name)
    # The engine's side: its base copy + the adapter from the wire (plain torch, no PEFT)
    packed = pack_weights(trainer.weight_update())
    base = load_model(builtin_dir(), torch.float32)
    served = copy.deepcopy(base)
    n = lora.merge_into(served, dict(base.named_parameters()), unpack_weights(packed.meta, packed.buffers),
                        packed.meta["adapter"]["scaling"])
    assert n == 2 * 7 + 1
    tokens = torch.randint(3, 50, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = token_logprobs(served(tokens).logits, tokens)
        lp = token_logprobs(trainer.backend.logits(tokens), tokens)
    torch.testing.assert_close(got, lp, rtol=0, atol=1e-5)
    # merging twice is from the base, never on top of the served weights
    lora.merge_into(served, dict(base.named_parameters()), unpack_weights(packed.meta, packed.buffers), 2.0)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(served(tokens).logits, tokens), lp, rtol=0, atol=1e-5)


def test_the_reference_is_the_base_with_the_adapter_disabled():
    trainer = Trainer(lora_spec(**{"algorithm.klCoef": 0.1}), model_dir=builtin_dir())
    assert trainer.backend.reference is None  # no frozen copy: PEFT's disable_adapter
    tokens = torch.randint(3, 50, (2, 10), generator=torch.Generator().manual_seed(2))
    base = load_model(builtin_dir(), torch.float32)
    randomize_adapter(trainer)
    ref = trainer.backend.reference_logprobs(tokens)
    with torch.no_grad():
        want = token_logprobs(base(tokens).logits, tokens)
        policy = token_logprobs(trainer.backend.logits(tokens), tokens)
    torch.testing.assert_close(ref, want, rtol=0, atol=1e-5)
    assert (policy - want).abs().max() > 1e-2  # the adapter is back on after it


def test_a_tied_lm_head_is_refused_naming_target_modules(tmp_path):
    model_dir = write_tiny_model(tmp_path / "qwen2", "qwen2")  # tie_word_embeddings
    spec = parse_spec({"model": {"path": str(model_dir), "maxSequenceLength": 64}, "algorithm": {"maxSteps": 1},
                       "trainer": {"lora": {"targetModules": ["q_proj", "lm_head"]}}})
    with pytest.raises(ConfigError, match=r"spec.trainer.lora.targetModules: \['lm_head.weight'\] share"):
        Trainer(spec, model_dir=model_dir)
    with pytest.raises(ConfigError, match="spec.trainer.lora.targetModules"):
        Trainer(parse_spec({**spec.model_dump(by_alias=True, exclude_none=True),
                            "trainer": {"lora": {"targetModules": ["no_such_proj"]}}}), model_dir=model_dir)
