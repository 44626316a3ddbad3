"""loss sft from a dataset (task.dataset.completionField): the actor reads prompt + reference completion instead of
sampling, the documents put only the completion in the loss, and the tiny model learns held-out completions
through the Trainer API. The JSONL is the one examples/sft-cpu.yaml ships."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import torch

from support import specs
from rlkube.contract import protocol
from rlkube.contract.context import RoleContext
from rlkube.core.actor.role import Actor
from rlkube.core.backends.base import batch_loss
from rlkube.core.training.batch import collate
from rlkube.core.hf.loading import load_tokenizer
from rlkube.core.hf.source import materialize_model
from rlkube.core.training.losses import LossConfig
from rlkube.core.preprocessor.documents import DocumentConfig, group_to_documents
from rlkube.core.actor.task_types import Prompt, TaskError
from rlkube.core.actor.tasks import load_task
from rlkube.core.trainer import Trainer
from rlkube.lifecycle import validation
from rlkube.lifecycle.validation import parse_spec

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "sft-reverse-digits.jsonl"
SFT = {"algorithm.loss": "sft", "algorithm.groupSize": 1, "algorithm.samplesPerStep": 16,
       "algorithm.learningRate": 0.003, "task": {"name": "reverse-sft", "chatTemplate": False, "dataset": {
           "path": str(DATA), "completionField": "completion"}}}


def fields(spec: dict) -> list[str]:
    return [e.field for e in validation.semantic_errors(validation.TrainingJobSpec.model_validate(spec))]


def test_validation_names_the_completion_field():
    assert fields(specs.spec(**SFT)) == []  # no reward needed: nothing is sampled
    # sft without a completion field: on a built-in task, or on a dataset that does not map one
    assert "spec.task.dataset.completionField" in fields(specs.spec(**{"algorithm.loss": "sft"}))
    no_field = specs.spec(**{**SFT, "task.dataset.completionField": specs.DELETE, "task.reward": {"type": "exact"}})
    assert "spec.task.dataset.completionField" in fields(no_field)
    # a completion field with an RL loss is refused (it would never be read)
    rl = specs.spec(**{**SFT, "algorithm.loss": "grpo", "algorithm.groupSize": 4, "task.reward": {"type": "exact"}})
    assert fields(rl) == ["spec.task.dataset.completionField"]


def test_a_missing_completion_column_names_the_field(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "1:", "answer": "1"}) + "\n")
    spec = parse_spec(specs.spec(**{**SFT, "task.dataset.path": str(path)}))
    with pytest.raises(TaskError, match="completionField: no column 'completion'"):
        load_task(spec.task)


@pytest.fixture(scope="module")
def job():
    spec = parse_spec(specs.spec(**SFT))
    model_dir = materialize_model(spec.model)
    return spec, model_dir, load_tokenizer(model_dir)


def test_the_actor_reads_rows_without_inference_and_stamps_the_newest_version(job, redis_server, redis_client):
    spec, _, tok = job
    ctx = RoleContext("ns", "job", spec, redis_server.url)  # no inference URLs: the sft actor needs none
    task = load_task(spec.task)

    async def run():
        client = aioredis.Redis.from_url(redis_server.url)
        actor = Actor(ctx, client, task, tokenizer=tok)
        assert actor.supervised and actor.worker_count() == 1
        await actor._apply(protocol.TrainerEvent("5-0", protocol.WEIGHTS_READY,
                                                 {"type": "weights_ready", "version": 3, "step": 3,
                                                  "documents_seen": 48}))
        assert await actor.reserve() == 1  # one sample per row
        assert await actor.write_reference()
        await client.aclose()

    asyncio.run(run())
    (_, entry), = redis_client.xrange(ctx.keys.rollouts)
    group = protocol.RolloutGroup.decode(entry)
    rows = {r["prompt"]: r for r in map(json.loads, DATA.read_text().splitlines())}
    first = rows[tok.decode(group.prompt_tokens)]
    assert group.model_version == 3 and group.expected_size == 1 and len(group.samples) == 1
    assert group.prompt_tokens == tok.encode(first["prompt"])
    assert group.samples[0].completion_tokens == tok.hf(first["completion"], add_special_tokens=False)[
        "input_ids"] + [tok.eos_id]
    assert int(redis_client.get(ctx.keys.actor_samples_written)) == 1


def documents_of_rows(rows: list[dict], tok) -> list[protocol.Document]:
    """Rows -> the actor's one-sample groups -> the preprocessor's documents (sft: singletons kept)."""
    cfg = DocumentConfig(drop_singletons=False, max_length=32)
    actor = Actor.__new__(Actor)  # only reference_group's state: no Redis, no inference
    actor.tokenizer, actor.render, actor.scores, actor.name = tok, lambda p: p.text, False, "actor-0"
    docs = []
    for row in rows:
        docs += group_to_documents(actor.reference_group(Prompt(row["prompt"], {"completion": row["completion"]})),
                                   cfg)
    return docs


def held_out_rows(train: list[dict], n: int = 48) -> list[dict]:
    seen = {r["prompt"] for r in train}
    rng, rows = random.Random(1), []
    while len(rows) < n:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
        if f"{digits}:" not in seen:
            seen.add(f"{digits}:")
            rows.append({"prompt": f"{digits}:", "completion": digits[::-1]})
    return rows


@torch.no_grad()
def completion_loss(model, docs: list[protocol.Document], pad_id: int) -> float:
    """Mean negative log-likelihood of the completion tokens (the loss tokens) of `docs`."""
    batch = collate(docs, pad_id=pad_id)
    logp = torch.log_softmax(model(batch.tokens).logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    return float((nll * batch.loss_mask).sum() / batch.loss_mask.sum())


def test_sft_learns_held_out_completions_and_prompts_carry_no_gradient(job):
    spec, model_dir, tok = job
    train = [json.loads(line) for line in DATA.read_text().splitlines()]
    docs, held_out = documents_of_rows(train, tok), documents_of_rows(held_out_rows(train), tok)

    # The loss mask: exactly the completion (and its eos), never the prompt.
    for doc, row in zip(docs, train, strict=True):
        prompt = len(tok.encode(row["prompt"]))
        assert doc.loss_mask().tolist() == [False] * prompt + [True] * (len(doc.tokens) - prompt)
        assert doc.tokens[-1] == tok.eos_id

    torch.manual_seed(0)
    trainer = Trainer(spec, model_dir=model_dir)
    model = trainer.model

    # Gradient check: the sft loss's gradient w.r.t. the logits is zero at every position that predicts a prompt
    # token (and at padding) and non-zero where a completion token is predicted.
    batch = collate(docs[:4], pad_id=tok.pad_id)
    logits = model(batch.tokens).logits
    logits.retain_grad()
    batch_loss(logits, batch, LossConfig("sft"), 1.0, normalizer=batch.num_loss_tokens).loss.backward()
    per_position = logits.grad[:, :-1].abs().sum(-1)  # position j predicts token j + 1
    assert torch.all(per_position[~batch.loss_mask] == 0)
    assert torch.all(per_position[batch.loss_mask] > 0)
    model.zero_grad(set_to_none=True)

    model.eval()
    before = completion_loss(model, held_out, tok.pad_id)
    rng = random.Random(0)
    per_step = spec.algorithm.samples_per_step
    for _ in range(40):
        trainer.train_step(rng.sample(docs, per_step))
    after = completion_loss(model, held_out, tok.pad_id)
    train_after = completion_loss(model, docs, tok.pad_id)
    print(f"held-out completion loss {before:.3f} -> {after:.3f} (train {train_after:.3f}) in 40 steps")
    assert after < 0.6 * before
