"""The actor's three sampling modes, each making one rollout group: single-turn completions of a task's prompt
(`sample_group`), multi-turn episodes with an environment (`sample_episodes`, rlkube.core.actor.episodes), and the
supervised (sft) dataset's reference completions (`write_reference`), which are read, never sampled.

A mixin of rlkube.core.actor.role.Actor, which owns the state they use. What a group holds: docs/design.md §5.3;
sft groups and their version stamp: §6; a group's `model_version` is the weights that sampled it
(docs/references.md §6.9). A reward that raises scores 0 and is counted (`reward_errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import aiohttp

from rlkube.contract import counters, protocol
from rlkube.core.actor.episodes import (EpisodeResult, Reply, SampleRefused, call_with_timeout, draw_prompt,
                                        run_episode)
from rlkube.core.actor.inference_client import BadPrompt, Stopped, token_versions
from rlkube.core.actor.tasks import Prompt

log = logging.getLogger("rlkube.actor")


def supervised(spec) -> bool:
    """Whether the actor reads reference completions instead of sampling (loss sft with a completionField)."""
    ds = spec.task.dataset
    return spec.algorithm.loss == "sft" and ds is not None and ds.completion_field is not None


class SamplingModes:
    """Single-turn groups, multi-turn episodes and reference rows (mixed into rlkube.core.actor.role.Actor)."""

    async def sample_group(self, session: aiohttp.ClientSession, min_version: int | None
                           ) -> protocol.RolloutGroup | None:
        """One group, retrying failed requests until it succeeds or the actor stops; None on a bad prompt.
        `min_version`: the oldest weights that may sample it (passed to our native server)."""
        if self.environment is not None:
            return await self.sample_episodes(session, min_version)
        prompt = self.task.prompt(self.rng)
        text = self.render(prompt)
        version_at_start = self.view.version or 0
        try:
            reply = await self.request(session, text, min_version)
        except Stopped:
            return None
        except BadPrompt as exc:
            log.error("%s; skipping it", exc)
            return None
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        samples = []
        for c in choices:
            lp = (c.get("logprobs") or {}).get("token_logprobs") or []
            reward, failed = self.score(prompt, c["text"])
            samples.append(protocol.Sample(completion_tokens=[int(t) for t in c["token_ids"]],
                                           logprobs=[float(x) for x in lp], reward=reward,
                                           finished=c.get("finish_reason") == "stop", reward_error=failed))
        version = reply.get("model_version")
        return protocol.RolloutGroup(
            group_id=f"{self.name}-{uuid.uuid4().hex[:12]}",
            prompt_tokens=[int(t) for t in choices[0]["prompt_token_ids"]],
            samples=samples,
            model_version=int(version) if isinstance(version, int) else version_at_start,
            expected_size=self.algo.group_size,
            actor=self.name,
            created_at=time.time(),
        )

    # --- multi-turn episodes (rlkube.core.actor.episodes) ---------------------------------------------------

    @staticmethod
    def _reply(choice: dict, version: int) -> Reply:
        lp = (choice.get("logprobs") or {}).get("token_logprobs") or []
        ids = [int(t) for t in choice["token_ids"]]
        return Reply(token_ids=ids, logprobs=[float(x) for x in lp], version=version,
                     finished=choice.get("finish_reason") == "stop",
                     prompt_ids=[int(t) for t in choice["prompt_token_ids"]],
                     versions=token_versions(choice.get("model_versions"), len(ids)))

    async def sample_episodes(self, session: aiohttp.ClientSession, min_version: int | None
                              ) -> protocol.RolloutGroup | None:
        """A group of groupSize episodes from one prompt: their first replies in one request, then each episode
        on its own (token ids as prompts, rlkube.core.actor.episodes.run_episode); None when the actor stops, a server
        refuses the first prompt or the environment cannot start an episode."""
        prompt = draw_prompt(self.environment, self.task, self.rng)
        fallback = self.view.version or 0

        def version_of(reply: dict) -> int:
            v = reply.get("model_version")
            return int(v) if isinstance(v, int) else fallback

        async def sample(ids: list[int], max_tokens: int) -> Reply:
            try:
                reply = await self.request(session, ids, min_version, n=1, max_tokens=max_tokens)
            except BadPrompt as exc:
                raise SampleRefused(str(exc)) from None
            return self._reply(reply["choices"][0], version_of(reply))

        try:
            episodes = [await call_with_timeout(self.environment.start, prompt, timeout=self.limits.tool_timeout_s)
                        for _ in range(self.algo.group_size)]
        except Exception as exc:  # noqa: BLE001 - the environment's code (ToolTimeout included)
            log.error("the environment could not start an episode from %r: %s: %s; skipping it", prompt.text[:200],
                      type(exc).__name__, exc)
            return None
        rendered = self.render(prompt)
        max_tokens = self.algo.max_new_tokens
        if self.limits.max_episode_tokens is not None:
            length = len(rendered) if isinstance(rendered, list) else len(self.tokenizer.encode(rendered))
            max_tokens = min(max_tokens, self.limits.max_episode_tokens - length)
            if max_tokens < 1:
                log.error("prompt %r is %d tokens: no room for a reply within the episode budget of %d tokens; "
                          "skipping it", prompt.text[:200], length, self.limits.max_episode_tokens)
                return None
        try:
            first = await self.request(session, rendered, min_version, max_tokens=max_tokens)
            version = version_of(first)
            choices = sorted(first["choices"], key=lambda c: c["index"])
            runs = [asyncio.ensure_future(run_episode(ep, self._reply(c, version), sample, self.encoder,
                                                      self.tokenizer.decode, self.limits, self.algo.max_new_tokens))
                    for ep, c in zip(episodes, choices, strict=True)]
            try:
                results = await asyncio.gather(*runs)
            except BaseException:
                for run in runs:  # one stopped: the group is abandoned, its other episodes too
                    run.cancel()
                await asyncio.gather(*runs, return_exceptions=True)
                raise
        except Stopped:
            return None
        except BadPrompt as exc:
            log.error("%s; skipping it", exc)
            return None
        for r in results:
            r.drifted = self._drifted(prompt, r)
        return self.episode_group(results)

    def _drifted(self, prompt: Prompt, result: EpisodeResult) -> bool:
        """Whether rendering the episode's conversation whole gives other ids than the exact ones (counted)."""
        try:
            return self.encoder.drifted(prompt, result)
        except Exception as exc:  # noqa: BLE001 - a template that cannot render the whole conversation
            log.warning("the conversation cannot be re-rendered to check drift (%s: %s); counted as drifted",
                        type(exc).__name__, exc)
            return True

    def episode_group(self, results: list[EpisodeResult]) -> protocol.RolloutGroup:
        samples = [protocol.Sample(
            completion_tokens=r.tokens, logprobs=r.logprobs, reward=r.reward, finished=r.finished and not r.truncated,
            reward_error=r.reward_error, env_spans=r.env_spans, versions=r.versions, episode=r.counts())
            for r in results]
        return protocol.RolloutGroup(
            group_id=f"{self.name}-{uuid.uuid4().hex[:12]}",
            prompt_tokens=results[0].prompt_ids,
            samples=samples,
            # The oldest weights any token was sampled with: the lag bound holds for every token of the group.
            model_version=min(min(r.versions) for r in results),
            expected_size=self.algo.group_size,
            actor=self.name,
            created_at=time.time(),
        )

    def episode_totals(self, group: protocol.RolloutGroup) -> dict[str, int | float] | None:
        """A group's episode counts, added to the job's totals (the trainer reports them) by the script that writes
        the group (rlkube.core.actor.lag): None without an environment. Each is summed as its counter's type
        (rlkube.contract.counters), so a group without per-turn rewards still adds the float 0.0 to their sum."""
        if self.environment is None:
            return None
        return counters.group_totals([s.episode or {} for s in group.samples])

    # --- supervised (sft): reference completions from the dataset ------------------------------------

    def reference_group(self, prompt: Prompt) -> protocol.RolloutGroup:
        """One row as a one-sample group: the prompt's ids as inference would get them, the reference
        completion's ids plus eos, sampling log-probs 0, stamped with version 0 until it is written."""
        tok = self.tokenizer
        rendered = self.render(prompt)
        prompt_ids = list(rendered) if isinstance(rendered, list) else tok.encode(rendered)
        completion = prompt.meta["completion"]
        ids = list(tok.hf(completion, add_special_tokens=False)["input_ids"])
        if tok.eos_id is not None:
            ids.append(tok.eos_id)
        reward, failed = self.score(prompt, completion) if self.scores else (0.0, False)
        sample = protocol.Sample(completion_tokens=ids, logprobs=[0.0] * len(ids), reward=reward, finished=True,
                                 reward_error=failed)
        return protocol.RolloutGroup(group_id=f"{self.name}-{uuid.uuid4().hex[:12]}", prompt_tokens=prompt_ids,
                                     samples=[sample], model_version=0, expected_size=1, actor=self.name,
                                     created_at=time.time())

    async def write_reference(self) -> bool:
        """Read the next row and write it (module docstring: the version it is stamped with); False when the
        actor stopped first."""
        group = self.reference_group(self.task.prompt(self.rng))
        while not self.stop.is_set():
            changed = self.changed
            group.model_version = self.view.version or 0
            if await self.lag.write(group, self.view.documents_seen) is not None:
                self._count(group)
                return True
            self.resampled += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=1.0)
        return False
