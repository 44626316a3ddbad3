"""The Trainer API of docs/design.md §6 on the torch backend (the tiny HF Llama): accumulation, zeroing,
versions, micro-batches by a token budget, the learning-rate schedule, float32 master weights under bfloat16
compute, backends."""

import copy

import numpy as np
import pytest
import torch

from rlkube.api.spec import TrainingJobSpec
from rlkube.lifecycle.validation import parse_spec
from rlkube.contract import protocol
from rlkube.core.backends import BackendUnavailable, build_backend
from rlkube.core.training.batch import collate, plan_micro_batches
from rlkube.core.trainer import Trainer

from support.hf_models import builtin_dir

SPEC = {
    "model": {"path": "builtin://tiny-llama", "maxSequenceLength": 16},
    "algorithm": {"maxSteps": 3, "samplesPerStep": 4},
    "inference": {"engine": "native"},
}


def docs(n=4, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(3, 20, size=6).astype(np.int64)
        old = np.zeros(6, dtype=np.float32)
        old[3:] = -3.0
        out.append(protocol.Document(tokens, [(0, 3)], advantage=float(rng.normal()), reward=0.5,
                                     old_log_probabilities=old, model_version=np.zeros(6, dtype=np.int64)))
    return out


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_collate_shifts_mask_and_logprobs():
    d = docs(1)[0]
    short = protocol.Document(d.tokens[:4], [(0, 3)], old_log_probabilities=d.old_log_probabilities[:4],
                              model_version=np.array([0, 0, 0, 5]))
    b = collate([d, short], pad_id=0)
    assert b.tokens.shape == (2, 6) and b.tokens[1, 4:].tolist() == [0, 0]
    # predicting token j+1: prompt tokens 1..2 excluded, completion tokens 3..5 included; padding never
    assert b.loss_mask.tolist() == [[False, False, True, True, True], [False, False, True, False, False]]
    assert b.old_logprobs[0].tolist() == [0, 0, -3, -3, -3]
    assert b.min_version.tolist() == [0, 5]
    assert b.num_loss_tokens == 4
    with pytest.raises(ValueError, match="maxSequenceLength 5"):
        collate([d], max_length=5)


def test_gradients_accumulate_across_calls_and_zero_after_step():
    spec = parse_spec(SPEC)
    trainer = Trainer(spec, micro_batch_tokens=24)  # 4 documents of 6 tokens: one micro-batch
    batch = trainer.make_batch(docs(4))
    n = batch.num_loss_tokens
    trainer.forward_backward(batch, normalizer=n)
    whole = grads(trainer.model)
    trainer.model.zero_grad(set_to_none=True)
    # two calls on halves with the step normaliser: the same gradient as one call on the whole
    for half in batch.split(2):
        trainer.forward_backward(half, normalizer=n)
    for name, g in grads(trainer.model).items():
        torch.testing.assert_close(g, whole[name], rtol=1e-5, atol=1e-7)
    before = copy.deepcopy(trainer.model.state_dict())
    out = trainer.optim_step()
    assert out["policy_version"] == 1 and out["step"] == 1 and out["grad_norm"] > 0
    assert all(p.grad is None for p in trainer.model.parameters())  # zeroed after the step
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_micro_batch_budget_does_not_change_the_step():
    spec = parse_spec(SPEC)
    a, b = Trainer(spec, micro_batch_tokens=4096), Trainer(spec, micro_batch_tokens=1)  # one pass vs one per doc
    assert len(a.micro_batches(docs(4))) == 1 and len(b.micro_batches(docs(4))) == 4
    ga, gb = grads_at_step(a), grads_at_step(b)
    ma, mb = a.train_step(docs(4)), b.train_step(docs(4))
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5)
    assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-5)
    # The step's gradient is the same, up to float32 summation order.
    assert ga.keys() == gb.keys() and ga
    for name, g in ga.items():
        torch.testing.assert_close(g, gb[name], rtol=1e-5, atol=1e-7)
    # So is the update, wherever Adam's direction g / (|g| + eps) is defined by the gradient: for a gradient
    # near eps (1e-8) the summation order alone moves the update by up to the learning rate (seen: 9e-6).
    params_a, params_b = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    for name, g in ga.items():
        settled = g.abs() > 1e-5
        assert settled.any()
        torch.testing.assert_close(params_a[name].detach()[settled], params_b[name].detach()[settled],
                                   rtol=1e-5, atol=1e-6)


def grads_at_step(trainer) -> dict[str, torch.Tensor]:
    """The gradients the optimizer steps on, copied just before its step (train_step zeroes them after)."""
    seen: dict[str, torch.Tensor] = {}

    def copy_grads(_optimizer, _args, _kwargs):
        seen.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None})

    trainer.backend.optimizer.register_step_pre_hook(copy_grads)
    return seen


def test_backend_selector_names_the_field():
    for backend, gpus in (("fast-llm", 1), ("megatron", 1)):
        # model_validate, not parse_spec: the selector must hold even without the semantic checks in front of it
        spec = TrainingJobSpec.model_validate({**SPEC, "trainer": {"backend": backend, "gpusPerNode": gpus}})
        try:
            build_backend(spec, builtin_dir())
        except BackendUnavailable as exc:
            assert f"spec.trainer.backend '{backend}'" in str(exc)
        else:
            assert backend == "megatron", "fast-llm must never run in our trainer"


def test_micro_batches_are_cut_by_tokens_longest_first():
    lengths = [5, 20, 7, 6, 30, 4]
    plans = plan_micro_batches(lengths, budget=30)
    assert plans == [[4], [1], [2, 3, 0, 5]]  # 30 alone, 20 alone (2 x 20 > 30), then 4 x 7 = 28 <= 30
    assert sorted(i for p in plans for i in p) == list(range(len(lengths)))
    for p in plans:
        assert len(p) == 1 or len(p) * max(lengths[i] for i in p) <= 30
    with pytest.raises(ValueError, match=">= 1"):
        plan_micro_batches(lengths, 0)


@pytest.mark.parametrize(("schedule", "expected"), [
    ("constant", [0.5, 1.0, 1.0, 1.0]),
    ("linear", [0.5, 1.0, 2 / 3, 1 / 3]),
    ("cosine", [0.5, 1.0, 0.75, 0.25]),
])
def test_learning_rate_warms_up_then_follows_the_schedule(schedule, expected):
    spec = parse_spec({**SPEC, "algorithm": {"maxSteps": 5, "samplesPerStep": 4, "learningRate": 0.01,
                                             "warmupSteps": 2, "lrSchedule": schedule}})
    trainer = Trainer(spec)
    lrs = []
    for _ in range(4):
        lrs.append(trainer.train_step(docs(4))["lr"])
    lrs.append(trainer.backend.learning_rate)
    # warm-up: 0 at the first step, 0.5 at the second... (transformers' schedules, stepped after each update)
    assert lrs[0] == 0.0
    assert [x / 0.01 for x in lrs[1:]] == pytest.approx(expected, abs=1e-6)


def test_bfloat16_training_keeps_float32_masters_so_small_updates_accumulate():
    """lr = 1e-4 and Adam's first steps move every weight by about lr. The RMSNorm weights are 1.0, where
    bfloat16's spacing is 2^-7 = 0.0078: a model stored in bfloat16 rounds every such update away (1 - 1e-4 is 1.0
    in bfloat16), so after 20 steps it has not moved at all. With float32 masters under bfloat16 compute the
    updates accumulate to about 20 x 1e-4."""
    spec = parse_spec({**SPEC, "model": {**SPEC["model"], "dtype": "bfloat16"},
                       "algorithm": {"maxSteps": 20, "samplesPerStep": 4, "learningRate": 1e-4}})
    trainer = Trainer(spec)
    norm = dict(trainer.model.named_parameters())["model.norm.weight"]
    assert norm.dtype == torch.float32 and trainer.backend.compute_dtype == torch.bfloat16
    start = norm.detach().clone()

    pure = copy.deepcopy(trainer.model).to(torch.bfloat16)  # the counterfactual: weights and Adam in bfloat16
    pure_norm = dict(pure.named_parameters())["model.norm.weight"]
    pure_opt = torch.optim.Adam(pure.parameters(), lr=1e-4)
    batch = trainer.make_batch(docs(4))
    for step in range(20):
        trainer.train_step(docs(4, seed=step))
        pure_opt.zero_grad()
        logits = pure(batch.tokens).logits.float()
        (logits[:, :-1].log_softmax(-1).gather(-1, batch.tokens[:, 1:, None]) * batch.advantages[:, None, None]).mean() \
            .backward()
        assert pure_norm.grad.abs().max() > 0  # it gets gradients: its updates are rounded away, not missing
        pure_opt.step()

    moved = (norm.detach() - start).abs()
    assert moved.max() > 10e-4, moved.max()  # float32 masters: many 1e-4 steps added up
    assert torch.equal(pure_norm.detach().float(), start), "pure bfloat16 weights should not have moved at all"
    # what is published (and checkpointed) is the float32 master
    published = dict(trainer.backend.weights())["model.norm.weight"]
    assert published.dtype == torch.float32 and torch.equal(published, norm.detach())


def test_gradient_checkpointing_recomputes_to_the_same_step():
    plain = Trainer(parse_spec(SPEC))
    ckpt = Trainer(parse_spec({**SPEC, "trainer": {"gradientCheckpointing": True}}))
    layers = ckpt.model.model.layers
    assert all(layer.gradient_checkpointing for layer in layers)  # each decoder layer recomputes in backward
    assert not any(layer.gradient_checkpointing for layer in plain.model.model.layers)
    ma, mb = plain.train_step(docs(4)), ckpt.train_step(docs(4))
    assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-5)
    for k, v in plain.model.state_dict().items():
        torch.testing.assert_close(v, ckpt.model.state_dict()[k], rtol=1e-5, atol=1e-6)


def test_float16_training_is_refused_naming_the_field():
    from rlkube.core.hf import ModelError

    with pytest.raises(ModelError, match=r"^spec\.model\.dtype: the torch backend trains in float32 or bfloat16"):
        Trainer(parse_spec({**SPEC, "model": {**SPEC["model"], "dtype": "float16"}}))
