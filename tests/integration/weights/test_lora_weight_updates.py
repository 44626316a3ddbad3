"""spec.trainer.lora across the real pieces (docs/design.md §5.6, §6): the adapter-only update through the
weight-update group (WeightPublisher -> gloo -> WeightFollower, announced on Redis) with its bytes and time against
the full weights, the native engine's log-probs after it equal to the trainer's, a receiver that takes full weights
refusing it, the checkpoint loaded by `PeftModel.from_pretrained`, and a resume whose adapter is gone or torn failing
with a ConfigError naming the path. float32 throughout: log-probs agree to 1e-4 (measured ~1e-6)."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from cluster.control_plane import free_port
from support.hf_models import builtin_dir
from rlkube.contract import protocol
from rlkube.core.training import lora
from rlkube.core.errors import ConfigError
from rlkube.core.hf.loading import load_model, load_tokenizer
from rlkube.core.inference.native_engine import NativeEngine
from rlkube.core.inference.shell import WeightFollower
from rlkube.core.training.losses import token_logprobs
from rlkube.core.inference.sampling import GenerationRequest, SamplingEngine
from rlkube.core.trainer import Trainer
from rlkube.core.weights.group import WeightReceiver, WeightSender, WeightSyncError
from rlkube.core.weights.publication import WeightPublisher
from rlkube.core.weights.wire import ADAPTER, checksums_match, update_nbytes
from rlkube.lifecycle.validation import parse_spec
from support.waiting import wait_for
from support import specs
from support.lora_updates import TARGETS, documents

pytestmark = pytest.mark.integration



def lora_spec(**overrides):
    return parse_spec(specs.spec(**{"trainer.lora": {"rank": 8, "alpha": 16, "targetModules": TARGETS},
                                    "inference.engine": "native", "algorithm.learningRate": 0.03, **overrides}))




def test_the_engine_serves_base_plus_adapter_from_an_adapter_only_update(redis_client):
    model_dir = builtin_dir()
    trainer = Trainer(lora_spec(), model_dir=model_dir)
    tok = load_tokenizer(model_dir)
    keys = protocol.StreamKeys("test/lora/")
    addr = f"127.0.0.1:{free_port()}"
    served = load_model(model_dir)
    engine = SamplingEngine(served, tok, version=0, seed=1)
    receiver = WeightReceiver(addr, rank=1, world_size=2, timeout_s=30, local_host="127.0.0.1")
    follower = WeightFollower(redis_client, keys, NativeEngine(engine, receiver, copy.deepcopy(served))).start()
    publisher = WeightPublisher(redis_client, keys, addr, 2, timeout_s=30, local_host="127.0.0.1",
                                transfer_dtype=torch.float32)
    try:
        start = threading.Thread(target=publisher.start, args=(trainer.weight_update(),), daemon=True)
        start.start()
        start.join(60)
        assert follower.synced.wait(30) and engine.policy.version == 0
        assert receiver.last_meta["kind"] == ADAPTER

        for step in range(3):
            assert trainer.train_step(documents(8, seed=step))["grad_norm"] > 0
        t0 = time.monotonic()
        publisher.publish(trainer.weight_update(), version=trainer.version, step=trainer.step)
        wait_for(lambda: engine.policy.version == 3, 30, "the adapter update of version 3")
        publish_s = time.monotonic() - t0
        adapter_bytes = update_nbytes(publisher.sender.pack(trainer.weight_update()).meta)
        full_bytes = update_nbytes(publisher.sender.pack(trainer.backend.weights()).meta)
        print(f"adapter update: {adapter_bytes} bytes vs full weights {full_bytes} bytes; publish + apply "
              f"{publish_s * 1e3:.1f} ms (transfer {publisher.last_transfer_s * 1e3:.1f} ms, engine "
              f"receive + merge {follower.last_update_s * 1e3:.1f} ms)")
        assert adapter_bytes < full_bytes / 5
        assert receiver.last_meta["adapter"]["scaling"] == 2.0
        assert checksums_match(follower.served_checksum, publisher.sender.pack(trainer.weight_update()).meta["checksum"])

        # The engine's sampling log-probs are the trainer's (base + adapter), and the adapter moved them.
        reqs = [GenerationRequest(tok.encode(p), n=3, max_tokens=6, temperature=1.0, top_logprobs=0, seed=i)
                for i, p in enumerate(["reverse 123:", "reverse 98765:"])]
        compared, moved = 0, 0.0
        base = load_model(model_dir)
        for req, result in zip(reqs, engine.generate(reqs), strict=True):
            assert result.version == 3
            for c in result.completions:
                tokens = torch.tensor([req.prompt_ids + c.token_ids])
                with torch.no_grad():
                    want = token_logprobs(trainer.backend.logits(tokens), tokens)[0, len(req.prompt_ids) - 1:]
                    at_base = token_logprobs(base(tokens).logits, tokens)[0, len(req.prompt_ids) - 1:]
                assert c.logprobs == pytest.approx(want.tolist(), abs=1e-4)
                moved = max(moved, float((want - at_base).abs().max()))
                compared += len(c.logprobs)
        assert compared >= 6 and moved > 1e-2

        # The same update as full weights (what a full-weight job, or vLLM under LoRA, sends), for the time.
        adapter_s = follower.last_update_s
        publisher.publish(trainer.backend.weights(), version=4, step=trainer.step)
        wait_for(lambda: engine.policy.version == 4, 30, "the full-weight update of version 4")
        print(f"engine update (receive + apply): adapter {adapter_s * 1e3:.1f} ms, full weights "
              f"{follower.last_update_s * 1e3:.1f} ms (tiny-llama: both tens of ms, noisy on a shared machine)")
    finally:
        follower.stop(5)
        publisher.close()


def test_a_receiver_that_takes_full_weights_refuses_an_adapter_update():
    addr = f"127.0.0.1:{free_port()}"
    trainer = Trainer(lora_spec(), model_dir=builtin_dir())
    sender = WeightSender(addr, 2, timeout_s=20, local_host="127.0.0.1")
    receiver = WeightReceiver(addr, rank=1, world_size=2, timeout_s=20, local_host="127.0.0.1")
    epoch = sender.open()
    send = threading.Thread(target=lambda: sender.send(trainer.weight_update(), 1), daemon=True)
    send.start()
    try:
        receiver.join(epoch)
        with pytest.raises(WeightSyncError, match="'lora-adapter' update, which this engine does not serve"):
            receiver.receive()  # as vLLM's worker calls it
        send.join(20)
    finally:
        receiver.close()
        sender.close()


def test_checkpoint_is_a_peft_adapter_and_resume_fails_without_it(tmp_path):
    from peft import PeftModel

    spec = lora_spec()
    model_dir = builtin_dir()
    trainer = Trainer(spec, checkpoint_dir=tmp_path / "ckpt", model_dir=model_dir)
    for step in range(2):
        trainer.train_step(documents(8, seed=step))
    path = trainer.save_checkpoint()
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "meta.json"} <= {
        p.name for p in path.iterdir()}
    assert not (path / "model.safetensors").exists()

    # PEFT loads it onto the base, with the trainer's logits.
    peft_model = PeftModel.from_pretrained(load_model(model_dir, torch.float32), str(path))
    tokens = torch.tensor([d.tokens for d in documents(3, seed=9)])
    with torch.no_grad():
        torch.testing.assert_close(peft_model(tokens).logits, trainer.backend.logits(tokens), rtol=0, atol=1e-5)

    # A resume takes the adapter and Adam's state back.
    resumed = Trainer(spec, checkpoint_dir=tmp_path / "ckpt", model_dir=model_dir)
    assert resumed.resume() == path and resumed.step == 2
    want_state, want_opt = trainer.backend.state()
    got_state, got_opt = resumed.backend.state()
    assert set(got_state) == set(want_state)
    for name in want_state:
        assert torch.equal(got_state[name], want_state[name]), name
    assert got_opt["optimizer"]["state"][0]["step"] == want_opt["optimizer"]["state"][0]["step"] == 2

    # The adapter file torn, then deleted: the resume fails naming the path, never a fresh adapter.
    weights = path / lora.ADAPTER_WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ConfigError, match=f"spec.trainer.lora: the checkpoint's adapter {weights} is unreadable"):
        Trainer(spec, checkpoint_dir=tmp_path / "ckpt", model_dir=model_dir).resume()
    weights.unlink()
    with pytest.raises(ConfigError, match=f"spec.trainer.lora: the checkpoint's adapter {weights} is missing"):
        Trainer(spec, checkpoint_dir=tmp_path / "ckpt", model_dir=model_dir).resume()

    # Another rank, or a full-weight job on the adapter checkpoint: refused naming the field.
    (tmp_path / "ckpt2").mkdir()
    trainer.checkpoint_dir = tmp_path / "ckpt2"
    trainer.save_checkpoint()
    other = lora_spec(**{"trainer.lora": {"rank": 4, "alpha": 8, "targetModules": TARGETS}})
    with pytest.raises(ConfigError, match="has rank 8 on .* the spec asks for rank 4"):
        Trainer(other, checkpoint_dir=tmp_path / "ckpt2", model_dir=model_dir).resume()
    full = parse_spec(specs.spec(**{"inference.engine": "native"}))
    with pytest.raises(ConfigError, match="holds a LoRA adapter"):
        Trainer(full, checkpoint_dir=tmp_path / "ckpt2", model_dir=model_dir).resume()
