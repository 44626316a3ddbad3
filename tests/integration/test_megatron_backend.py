"""The `megatron` backend in-process: a megatron-core GPTModel on CPU behind the Trainer API (megatron tier).

It computes TinyLM's function from TinyLM's weights, takes the same gradient and Adam steps as the torch backend,
accumulates gradients, learns the built-in task, and checkpoints in the backend-independent format (a megatron
checkpoint resumes on megatron exactly, and on the torch backend).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from learning_run import assert_reward_rose, learning_run, tiny_cpu_spec
from megatron_tier import megatron_core  # noqa: F401  (autouse: fails the tier without megatron-core)
from rlkube.api.validation import parse_spec
from rlkube.core import checkpoint as ckpt
from rlkube.core import protocol
from rlkube.core.model import CharTokenizer, build_model
from rlkube.core.trainer import Trainer

pytestmark = [
    pytest.mark.megatron,
    # megatron 0.16 warns on every tensor-parallel layer call without an explicit tp_group (size 1 here)
    pytest.mark.filterwarnings("ignore:.*tp_group is None:DeprecationWarning"),
]

ARCH = {"layers": 2, "hiddenSize": 64, "heads": 4, "maxSequenceLength": 32}


def spec_of(backend: str, dtype: str = "float32", **algorithm):
    return parse_spec({
        "model": {"path": "builtin://tiny-lm", "seed": 5, "architecture": ARCH, "dtype": dtype},
        "algorithm": {"maxSteps": 10, "samplesPerStep": 8, "learningRate": 0.003, **algorithm},
        "inference": {"engine": "native"},
        "trainer": {"backend": backend},
    })


def documents(n: int = 8, seed: int = 0) -> list[protocol.Document]:
    """Prompt 4 tokens (excluded), completion 3-6 tokens with sampling log-probs; varied lengths pad the batch."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = 4 + int(rng.integers(3, 7))
        tokens = rng.integers(3, 40, size=length).astype(np.int64)
        tokens[0] = 1
        old = np.zeros(length, dtype=np.float32)
        old[4:] = -rng.uniform(3.0, 4.5, size=length - 4)
        out.append(protocol.Document(tokens, [(0, 4)], advantage=float(rng.normal()), reward=0.5,
                                     old_log_probabilities=old, model_version=np.zeros(length, dtype=np.int64)))
    return out


def tiny_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The backend's gradients in TinyLM names and layout."""
    from rlkube.core.backends.megatron_layout import tiny_layout, tiny_name

    backend = trainer.backend
    if not hasattr(backend, "tiny_names"):
        return {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
    return {tiny_name(n): tiny_layout(n, p.grad, backend.heads).clone()
            for n, p in backend.model.named_parameters() if p.grad is not None}


def test_gpt_model_computes_tinylm_logits_on_cpu():
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from rlkube.core.backends.megatron_cpu import (
        CpuRNGStatesTracker,
        DeviceMemoryBuffer,
    )

    trainer = Trainer(spec_of("megatron"))
    assert isinstance(trainer.model, GPTModel)
    assert all(p.device.type == "cpu" for p in trainer.model.parameters())
    assert isinstance(get_cuda_rng_tracker(), CpuRNGStatesTracker)  # the shim, not megatron's CUDA tracker
    assert isinstance(parallel_state.get_global_memory_buffer(), DeviceMemoryBuffer)
    tiny = build_model(spec_of("megatron").model)
    vocab = CharTokenizer().vocab_size
    tokens = torch.randint(0, vocab, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = tiny(tokens), trainer.backend.logits(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    published = dict(trainer.backend.weights())
    assert list(published) == list(tiny.state_dict())  # names and order the inference server expects
    for name, tensor in tiny.state_dict().items():
        assert torch.equal(published[name], tensor), name
    # dropout inside megatron's fork draws from the tracked CPU stream and leaves the default stream alone
    state = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        torch.rand(3)
    assert torch.equal(torch.get_rng_state(), state)


def test_one_step_reduces_the_loss_on_a_fixed_batch():
    trainer = Trainer(spec_of("megatron"))
    batch = trainer.make_batch(documents())
    first = trainer.forward_backward(batch)["loss"]
    trainer.optim_step()
    trainer.forward_backward(batch)
    second = trainer.optim_step()["loss"]  # the loss of the batch under the updated weights
    print(f"loss on a fixed batch: {first:.4f} -> {second:.4f}")
    assert second < first - 0.01


def test_gradients_accumulate_and_equal_the_torch_backends():
    meg, ref = Trainer(spec_of("megatron"), micro_batch_size=8), Trainer(spec_of("torch"), micro_batch_size=8)
    batch = meg.make_batch(documents())
    n = batch.num_loss_tokens
    meg.forward_backward(batch, normalizer=n)
    whole = tiny_grads(meg)
    meg.model.zero_grad(set_to_none=True)
    for quarter in batch.split(2):  # four calls, each adding to the gradient
        meg.forward_backward(quarter, normalizer=n)
    accumulated = tiny_grads(meg)
    ref.forward_backward(batch, normalizer=n)
    torch_grads = tiny_grads(ref)
    assert accumulated.keys() == whole.keys() == torch_grads.keys()
    for name in whole:
        torch.testing.assert_close(accumulated[name], whole[name], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(whole[name], torch_grads[name], rtol=1e-4, atol=1e-6)
    out = meg.optim_step()
    assert out["policy_version"] == 1 and out["grad_norm"] > 0
    assert all(p.grad is None for p in meg.model.parameters())  # zeroed after the step


def test_same_training_trajectory_as_the_torch_backend():
    meg, ref = Trainer(spec_of("megatron")), Trainer(spec_of("torch"))
    for step in range(4):
        docs = documents(seed=step)
        m, r = meg.train_step(docs), ref.train_step(docs)
        assert m["loss"] == pytest.approx(r["loss"], rel=1e-4, abs=1e-6)
        assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
    published = dict(meg.backend.weights())
    for name, tensor in ref.model.state_dict().items():
        # Adam divides by sqrt(v): where a gradient is ~1e-9 the two summation orders' rounding noise can move
        # a weight by a visible fraction of lr, so the bound is loose per element and tight on average.
        diff = (published[name] - tensor).abs()
        assert diff.max() < 3e-4 and diff.mean() < 1e-6, (name, float(diff.max()), float(diff.mean()))


def test_bfloat16_parameters_like_the_torch_backend():
    meg, ref = Trainer(spec_of("megatron", "bfloat16")), Trainer(spec_of("torch", "bfloat16"))
    assert all(p.dtype == torch.bfloat16 for p in meg.model.parameters())
    docs = documents()
    m, r = meg.train_step(docs), ref.train_step(docs)
    assert m["loss"] == pytest.approx(r["loss"], rel=2e-2)
    published = dict(meg.backend.weights())
    assert all(t.dtype == torch.bfloat16 for t in published.values())  # no cast on the way to inference (6.15)
    for name, tensor in ref.model.state_dict().items():
        assert (published[name].float() - tensor.float()).abs().mean() < 1e-3, name


def test_checkpoint_resumes_exactly_and_on_the_torch_backend(tmp_path):
    first = Trainer(spec_of("megatron"), checkpoint_dir=tmp_path)
    first.train_step(documents(seed=1))
    first.train_step(documents(seed=2))
    path = first.save_checkpoint()
    meta = ckpt.read_meta(path)
    assert meta.step == 2 and meta.extra == {"backend": "megatron"}
    # model.safetensors is TinyLM's state_dict: the native inference server and a torch trainer can load it
    tiny = build_model(spec_of("megatron").model)
    ckpt.load_checkpoint(path, tiny)

    resumed = Trainer(spec_of("megatron"), checkpoint_dir=tmp_path)
    assert resumed.resume() == path and resumed.step == 2
    for (name, a), (_, b) in zip(first.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    on_torch = Trainer(spec_of("torch"), checkpoint_dir=tmp_path)
    assert on_torch.resume() == path and on_torch.step == 2
    # the next step (it uses Adam's moments and step count) is the same on all three
    docs = documents(seed=3)
    losses = [t.train_step(docs)["loss"] for t in (first, resumed, on_torch)]
    assert losses[1] == losses[0]
    assert losses[2] == pytest.approx(losses[0], rel=1e-4)
    for (name, a), (_, b) in zip(first.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    after = dict(first.backend.weights())
    for name, tensor in on_torch.model.state_dict().items():
        torch.testing.assert_close(after[name], tensor, rtol=1e-4, atol=2e-5)
    # and back: a torch checkpoint resumes on megatron
    torch_path = on_torch.save_checkpoint()
    back = Trainer(spec_of("megatron"), checkpoint_dir=tmp_path)
    assert back.resume() == torch_path and back.step == 3
    for name, tensor in dict(back.backend.weights()).items():
        assert torch.equal(tensor, on_torch.model.state_dict()[name]), name


@pytest.mark.parametrize("seed", [0, 1])
def test_a_short_learning_run_raises_the_reward(seed):
    """examples/tiny-cpu.yaml's job on the megatron backend, sampling from a TinyLM that receives the published
    weights after every step (what the native inference server does): reverse-digits reward rises."""
    rewards = learning_run(tiny_cpu_spec(backend="megatron"), seed, steps=40, served=True)
    # the torch backend's learnability test asserts the same margins for the same job
    assert_reward_rose(rewards, f"megatron backend, seed {seed}")
