"""The `megatron` backend in-process: the job's Hugging Face model as a megatron-core GPTModel on CPU behind the
Trainer API (megatron tier).

On the same checkpoint and batch it gives the torch backend's loss and gradient norm (grpo and sft, Llama, Qwen2 and
Qwen3), publishes the directory's own weights under Hugging Face names, accumulates gradients, trains bfloat16 with
float32 masters, checkpoints as a Hugging Face directory that transformers loads, and learns the built-in task.

Tolerances (float32, CPU; measured on these tiny models): first step loss and gradient norm within 1e-5
relative of the torch backend's (measured <= 2e-7 and <= 1e-6); over three Adam steps within 1e-4 (measured
<= 1e-5), since Adam's division by sqrt(v) amplifies rounding where a gradient is tiny. bfloat16 (the torch backend
autocasts float32 weights, megatron computes with bfloat16 copies of float32 masters): first step within 2e-3
relative (measured <= 3e-4).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.hf_models import write_tiny_model
from support.learning_run import assert_reward_rose, learning_run, tiny_cpu_spec
from support.megatron_tier import megatron_core  # noqa: F401  (autouse: fails the tier without megatron-core)
from rlkube.lifecycle.validation import parse_spec
from rlkube.core.training import checkpoint as ckpt
from rlkube.contract import protocol
from rlkube.core.trainer import Trainer

pytestmark = [
    pytest.mark.megatron,
    # megatron 0.16 warns on every tensor-parallel layer call without an explicit tp_group (size 1 here)
    pytest.mark.filterwarnings("ignore:.*tp_group is None:DeprecationWarning"),
]

ARCHS = ("llama", "qwen2", "qwen3")  # untied Llama; tied Qwen2 and Qwen3 (q/k norms), all with GQA
FIRST_STEP_RTOL = 1e-5
STEPS_RTOL = 1e-4
BF16_RTOL = 1e-2
BF16_LOSS_ATOL = 1e-3


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=1)


def spec_of(model_dir, backend: str, dtype: str = "float32", **algorithm):
    return parse_spec({
        "model": {"path": str(model_dir), "dtype": dtype, "maxSequenceLength": 64},
        "algorithm": {"maxSteps": 10, "samplesPerStep": 8, "learningRate": 0.003, **algorithm},
        "inference": {"engine": "native"},
        "trainer": {"backend": backend},
        # sft trains on a dataset's reference completions (validation asks for the field; nothing reads it here)
        **({"task": {"dataset": {"path": "/data/sft.jsonl", "completionField": "completion"}}}
           if algorithm.get("loss") == "sft" else {}),
    })


def trainers(model_dir, dtype: str = "float32", **algorithm) -> tuple[Trainer, Trainer]:
    return (Trainer(spec_of(model_dir, "megatron", dtype, **algorithm), model_dir=model_dir),
            Trainer(spec_of(model_dir, "torch", dtype, **algorithm), model_dir=model_dir))


def documents(n: int = 8, seed: int = 0, sft: bool = False) -> list[protocol.Document]:
    """Prompt of 4 tokens (excluded), completions of 3-20 tokens with sampling log-probs (none for sft); varied
    lengths pad the batch."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = 4 + int(rng.integers(3, 21))
        tokens = rng.integers(3, 40, size=length).astype(np.int64)
        old = np.zeros(length, dtype=np.float32)
        old[4:] = -rng.uniform(3.0, 4.5, size=length - 4)
        out.append(protocol.Document(tokens, [(0, 4)], advantage=float(rng.normal()), reward=0.5,
                                     old_log_probabilities=None if sft else old,
                                     model_version=np.zeros(length, dtype=np.int64)))
    return out


def test_the_backend_publishes_the_directorys_weights_under_their_names(model_dir):
    from megatron.core.models.gpt.gpt_model import GPTModel

    meg = Trainer(spec_of(model_dir, "megatron"), model_dir=model_dir)
    assert isinstance(meg.model, GPTModel)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in meg.model.parameters())
    published = dict(meg.backend.weights())
    on_disk = ckpt.load_weights(model_dir)
    assert sorted(published) == sorted(on_disk)  # HF names, a tied embedding once
    for name, tensor in on_disk.items():
        assert torch.equal(published[name], tensor), name


@pytest.mark.parametrize("loss", ["grpo", "sft"])
def test_same_loss_and_grad_norm_as_the_torch_backend(model_dir, loss):
    meg, ref = trainers(model_dir, loss=loss)
    for step in range(3):
        docs = documents(seed=step, sft=loss == "sft")
        m, r = meg.train_step(docs), ref.train_step(docs)
        rtol = FIRST_STEP_RTOL if step == 0 else STEPS_RTOL
        print(f"{model_dir.name} {loss} step {step}: loss {m['loss']:.7f} vs {r['loss']:.7f}, "
              f"grad norm {m['grad_norm']:.7f} vs {r['grad_norm']:.7f}")
        assert m["loss"] == pytest.approx(r["loss"], rel=rtol)
        assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=rtol)
        assert m["loss_tokens"] == r["loss_tokens"] and m["lr"] == r["lr"]
        if loss == "grpo":
            assert m["clipped_fraction"] == pytest.approx(r["clipped_fraction"])
    published, want = dict(meg.backend.weights()), dict(ref.backend.weights())
    for name, tensor in want.items():
        diff = (published[name] - tensor).abs()
        assert diff.mean() < 1e-5, (name, float(diff.max()), float(diff.mean()))


def test_gradients_accumulate_over_micro_batches(model_dir):
    meg = Trainer(spec_of(model_dir, "megatron"), model_dir=model_dir)
    batch = meg.make_batch(documents())
    n = batch.num_loss_tokens
    meg.backend.forward_backward(batch, normalizer=n)
    whole = {name: p.grad.clone() for name, p in meg.model.named_parameters()}
    meg.model.zero_grad(set_to_none=True)
    for quarter in batch.split(2):  # four calls, each adding to the gradient
        meg.backend.forward_backward(quarter, normalizer=n)
    for name, p in meg.model.named_parameters():
        torch.testing.assert_close(p.grad, whole[name], rtol=1e-4, atol=1e-7)
    out = meg.optim_step()
    assert out["policy_version"] == 1 and out["grad_norm"] > 0
    assert all(p.grad is None for p in meg.model.parameters())  # zeroed after the step


def test_bfloat16_computes_with_float32_masters(model_dir):
    meg, ref = trainers(model_dir, "bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in meg.model.parameters())
    docs = documents()
    m, r = meg.train_step(docs), ref.train_step(docs)
    print(f"bf16 {model_dir.name}: loss {m['loss']:.6f} vs {r['loss']:.6f}, grad norm {m['grad_norm']:.6f} vs "
          f"{r['grad_norm']:.6f}")
    assert m["loss"] == pytest.approx(r["loss"], rel=BF16_RTOL, abs=BF16_LOSS_ATOL)
    assert m["grad_norm"] == pytest.approx(r["grad_norm"], rel=BF16_RTOL)
    assert all(t.dtype == torch.float32 for _, t in meg.backend.weights())  # the masters (the publisher casts)
    # the accumulated gradient (what data parallelism sums) is the masters' float32 one, not the bfloat16 model's
    batch = meg.make_batch(docs)
    meg.backend.forward_backward(batch, batch.num_loss_tokens)
    assert all(p.grad is None for p in meg.model.parameters())
    grads = [p.grad for p in meg.backend.gradient_parameters()]
    assert len(grads) == len(list(meg.model.parameters()))
    assert all(g is not None and g.dtype == torch.float32 for g in grads)


def test_bfloat16_updates_below_its_resolution_accumulate(model_dir):
    """lr 1e-6 moves a weight by about 1e-6 per Adam step, far below bfloat16's spacing (2^-8 of the weight): added
    to a bfloat16 weight it rounds away, but the float32 masters collect every step."""
    meg = Trainer(spec_of(model_dir, "megatron", "bfloat16", learningRate=1e-6), model_dir=model_dir)
    start = {n: t.clone() for n, t in meg.backend.weights()}
    low = [p.detach().clone() for p in meg.model.parameters()]
    vanished = torch.cat([((w + 1e-6) == w).flatten() for w in low]).float().mean()
    assert vanished > 0.9  # in pure bfloat16 such an update is lost for most weights
    for step in range(10):
        meg.train_step(documents(seed=step))
    total = changed = 0
    for name, tensor in meg.backend.weights():
        moved = (tensor - start[name])[tensor != start[name]]  # embedding rows of unseen tokens stay
        assert moved.numel() and 1e-6 < float(moved.abs().mean()) < 2e-5, name
        total, changed = total + tensor.numel(), changed + moved.numel()
    assert changed > 0.7 * total
    after = [p.detach() for p in meg.model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(after, low, strict=True))  # the bfloat16 copy follows


def test_checkpoint_is_a_hf_directory_and_resumes_exactly(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    first = Trainer(spec_of(model_dir, "megatron"), checkpoint_dir=tmp_path, model_dir=model_dir)
    first.train_step(documents(seed=1))
    first.train_step(documents(seed=2))
    path = first.save_checkpoint()
    assert ckpt.read_meta(path).extra == {"backend": "megatron"}
    # transformers loads the checkpoint directory, and computes the backend's logits
    hf = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    tokens = meg_tokens = torch.randint(3, 40, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = float((hf(tokens).logits - first.backend.logits(meg_tokens)).abs().max())
    assert diff < 5e-5
    resumed = Trainer(spec_of(model_dir, "megatron"), checkpoint_dir=tmp_path, model_dir=model_dir)
    assert resumed.resume() == path and resumed.step == 2
    docs = documents(seed=3)
    assert resumed.train_step(docs)["loss"] == first.train_step(docs)["loss"]  # Adam's moments came back too
    for (name, a), (_, b) in zip(first.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    # the torch backend takes the megatron checkpoint's weights (not its optimizer state)
    on_torch = Trainer(spec_of(model_dir, "torch"), checkpoint_dir=tmp_path, model_dir=model_dir)
    assert on_torch.resume() == path
    for name, tensor in ckpt.load_weights(path).items():
        assert torch.equal(dict(on_torch.backend.weights())[name], tensor), name


@pytest.mark.parametrize("seed", [0, 1])
def test_a_short_learning_run_raises_the_reward(seed):
    """examples/tiny-cpu.yaml's job on the megatron backend, sampling from a transformers model that receives the
    published weights after every step (what the native inference server does): the reward rises."""
    rewards = learning_run(tiny_cpu_spec(backend="megatron"), seed, steps=40, served=True)
    # the torch backend's learnability test asserts the same margins for the same job
    assert_reward_rose(rewards, f"megatron backend, seed {seed}")


def test_an_architecture_the_mapping_does_not_cover_fails_naming_the_model(tmp_path):
    """A Llama with attention biases (o_proj too) loads in transformers, but megatron's add_qkv_bias would not
    compute it: the backend refuses it with the ModelError the trainer role turns into the job's Failed reason."""
    import json

    from rlkube.core.hf.errors import ModelError

    model_dir = write_tiny_model(tmp_path / "m", "llama")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(ModelError, match="spec.model.path.*attention_bias"):
        Trainer(spec_of(model_dir, "megatron"), model_dir=model_dir)
