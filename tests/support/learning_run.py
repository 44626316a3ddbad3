"""The learnability run that the torch backend's unit test and the megatron backend's test share:
examples/tiny-cpu.yaml's job, sampled with torch, grouped into RolloutGroups, turned into documents by the
preprocessor's code and trained with Trainer.train_step, and the reward-rise margins both assert for it."""

from __future__ import annotations

import random

import pytest
import torch
from rlkube.api.spec import TrainingJobSpec
from rlkube.lifecycle.validation import parse_spec
from rlkube.contract import protocol
from rlkube.core.hf import state as hf_state
from rlkube.core.hf.loading import load_model, load_tokenizer
from rlkube.core.hf.source import materialize_model
from rlkube.core.hf.tokenizer import Tokenizer
from rlkube.core.preprocessor.documents import DocumentConfig, documents_of
from rlkube.core.actor.tasks import load_task
from rlkube.core.trainer import Trainer
from support import specs


def tiny_cpu_spec(backend: str = "torch", **algorithm) -> TrainingJobSpec:
    return parse_spec(specs.spec(**{"trainer.backend": backend, **{f"algorithm.{k}": v for k, v in algorithm.items()}}))


@torch.no_grad()
def sample_group(model, tok: Tokenizer, prompt_ids: list[int], n: int, max_new: int, temperature: float):
    """n completions of one prompt: (tokens incl. <eos> when produced, sampling log-probs)."""
    out = torch.tensor([prompt_ids] * n)
    done = torch.zeros(n, dtype=torch.bool)
    comps: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    for _ in range(max_new):
        logp = torch.log_softmax(model(out).logits[:, -1].float() / temperature, dim=-1)
        nxt = torch.multinomial(logp.exp(), 1).squeeze(1)
        for i in range(n):
            if not done[i]:
                comps[i].append(int(nxt[i]))
                lps[i].append(float(logp[i, nxt[i]]))
        done |= torch.isin(nxt, torch.tensor(tok.eos_ids))
        if done.all():
            break
        out = torch.cat([out, nxt[:, None]], dim=1)
    return comps, lps


def learning_run(spec: TrainingJobSpec, seed: int, steps: int, served: bool = False) -> list[float]:
    """The mean reward of every step. `served`: sample from a separate HF model loaded from the job's directory that
    receives the trainer's published weights (HF names) after every step (what the native inference server does;
    needed where the backend's model is not an HF model), else from the trainer's own model."""
    algo = spec.algorithm
    model_dir = materialize_model(spec.model)
    tok, task = load_tokenizer(model_dir), load_task(spec.task)
    trainer = Trainer(spec, model_dir=model_dir)
    policy = load_model(model_dir) if served else trainer.model  # served: starts from the same weights
    rng = random.Random(seed)
    torch.manual_seed(seed)
    # As the preprocessor role configures it: zero-advantage groups are filtered (spec default), and the actors
    # sample more in their place (their lag credit comes back), so a step still gets samplesPerStep documents.
    cfg = DocumentConfig(estimator=algo.advantage, max_length=spec.model.max_sequence_length,
                         filter_zero_advantage=algo.filter_zero_advantage_groups and algo.loss != "sft")
    rewards, filtered = [], 0
    for step in range(steps):
        docs, step_rewards = [], []
        groups = algo.samples_per_step // algo.group_size
        for g in range(8 * groups):  # bounded: a policy whose every group is equal trains on what it has
            if g >= groups and len(docs) >= algo.samples_per_step:
                break
            prompt = task.prompt(rng)
            ids = tok.encode(prompt.text)
            comps, lps = sample_group(policy, tok, ids, algo.group_size, algo.max_new_tokens, algo.temperature)
            samples = [protocol.Sample(c, lp, task.reward(prompt, tok.decode(c))) for c, lp in zip(comps, lps, strict=True)]
            if g < groups:  # the reward of the policy: the first samplesPerStep samples, filtered or not
                step_rewards += [s.reward for s in samples]
            group = protocol.RolloutGroup(f"{step}-{g}", ids, samples, model_version=trainer.version,
                                          expected_size=algo.group_size)
            group_docs, filtered_reward = documents_of(group, cfg)
            docs += group_docs
            filtered += filtered_reward is not None
        if not docs:
            rewards.append(sum(step_rewards) / len(step_rewards))
            continue
        metrics = trainer.train_step(docs)
        # On-policy: the trainer's log-probs of the sampled tokens equal the sampling ones before the update.
        assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        if served:
            hf_state.load_weights(policy, dict(trainer.backend.weights()))
        rewards.append(sum(step_rewards) / len(step_rewards))
    print(f"{filtered} zero-advantage groups filtered in {steps} steps")
    return rewards


def assert_reward_rose(rewards: list[float], label: str) -> None:
    """The mean reward of the last 10 steps beats the first 10's by 0.10 and by 2x."""
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"{label}: reward first-10 {first:.3f} last-10 {last:.3f}")
    assert last - first > 0.10, rewards
    assert last > 2 * first, rewards
