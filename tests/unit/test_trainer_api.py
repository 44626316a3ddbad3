"""The Trainer API of design.md section 6 on the torch backend: accumulation, zeroing, versions, backends."""

import copy

import numpy as np
import pytest
import torch

from rlkube.api.spec import TrainingJobSpec
from rlkube.api.validation import parse_spec
from rlkube.core import protocol
from rlkube.core.backends import BackendUnavailable, build_backend
from rlkube.core.batch import collate
from rlkube.core.trainer import Trainer

SPEC = {
    "model": {"path": "builtin://tiny-lm", "architecture": {"layers": 1, "hiddenSize": 16, "heads": 2,
                                                             "maxSequenceLength": 16}},
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
    trainer = Trainer(spec, micro_batch_size=4)
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


def test_micro_batch_size_does_not_change_the_step():
    spec = parse_spec(SPEC)
    a, b = Trainer(spec, micro_batch_size=4), Trainer(spec, micro_batch_size=1)
    ma, mb = a.train_step(docs(4)), b.train_step(docs(4))
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5)
    for k, v in a.model.state_dict().items():
        torch.testing.assert_close(v, b.model.state_dict()[k], rtol=1e-5, atol=1e-6)


def test_backend_selector_names_the_field():
    for backend, gpus in (("fast-llm", 1), ("megatron", 1)):
        # model_validate, not parse_spec: the selector must hold even without the semantic checks in front of it
        spec = TrainingJobSpec.model_validate({**SPEC, "trainer": {"backend": backend, "gpusPerNode": gpus}})
        try:
            build_backend(spec)
        except BackendUnavailable as exc:
            assert f"spec.trainer.backend '{backend}'" in str(exc)
        else:
            assert backend == "megatron", "fast-llm must never run in our trainer"
