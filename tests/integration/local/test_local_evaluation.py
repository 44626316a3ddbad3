"""Evaluation while training through `rlkube local` (examples/tiny-cpu.yaml with spec.evaluation): the real roles over
a real redis-server. Actor 0 reports the held-out eval set's reward at exactly the weight versions due (0, 4, 8 and,
when the actors still run, 12), into the events stream, `evaluation.jsonl` and the summary; and not one training
document the trainer could read (the whole documents stream, read after training_finished) holds an eval prompt.
The same for multi-turn episodes (examples/calculator-cpu.yaml), whose eval prompts are played as whole episodes.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
from pathlib import Path

import redis
from support import ROOT, specs
import yaml
from support.local_cli import run_local, start_local, summary_of

from rlkube.contract import protocol
from rlkube.core.actor.environments import load_environment
from rlkube.core.actor.evaluation import build_eval_set
from rlkube.core.hf.loading import load_tokenizer
from rlkube.core.hf.source import materialize_model
from rlkube.lifecycle.validation import parse_spec

EVERY, STEPS, PROMPTS = 4, 12, 8


class StreamTap(threading.Thread):
    """Reads the job's events and documents streams (named in the runner's run.json) until its Redis is gone. A
    documents read that follows an events read holding training_finished has every document the trainer read
    (the stream is never trimmed)."""

    def __init__(self, out: Path, proc: subprocess.Popen):
        super().__init__(daemon=True)
        self.out, self.proc = out, proc
        self.events: list[protocol.TrainerEvent] = []
        self.documents: list[protocol.Document] = []
        self.complete = False
        self.done = threading.Event()

    def run(self) -> None:
        client, last_doc = None, "-"
        while self.proc.poll() is None:
            if client is None:
                if not (self.out / "run.json").exists():
                    self.done.wait(0.1)
                    continue
                run = json.loads((self.out / "run.json").read_text())
                client = redis.Redis.from_url(run["redis_url"], socket_timeout=5)
                keys = protocol.StreamKeys(run["events"][: -len(protocol.EVENTS_STREAM)])
            try:
                events = [protocol.decode_event(i, f) for i, f in client.xrange(keys.events)]
                finished = any(e is not None and e.type == protocol.TRAINING_FINISHED for e in events)
                docs = client.xrange(keys.documents, min=last_doc if last_doc == "-" else f"({last_doc}")
            except redis.RedisError:
                if self.complete:
                    break  # torn down after the final read
                self.done.wait(0.1)
                continue
            self.events = [e for e in events if e is not None]
            for entry_id, fields in docs:
                self.documents.append(protocol.decode_document(fields))
                last_doc = entry_id.decode()
            self.complete = self.complete or finished
            self.done.wait(0.05)


def run_job(tmp_path: Path, doc: dict) -> tuple[dict, StreamTap, Path]:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    out = tmp_path / "run"
    proc = start_local(manifest, "--json", "--output-dir", out)
    tap = StreamTap(out, proc)
    tap.start()
    stdout, stderr = proc.communicate(timeout=600)
    tap.done.set()
    tap.join(timeout=30)
    assert proc.returncode == 0, stderr[-3000:]
    summary = summary_of(stdout)
    print(json.dumps({k: summary[k] for k in ("phase", "eval_versions", "eval_reward_first", "eval_reward_last",
                                              "reward_first", "reward_last", "wall_seconds")}))
    assert summary["phase"] == "Succeeded" and summary["steps"] == doc["spec"]["algorithm"]["maxSteps"]
    assert summary["forced"] == [], summary  # the actor, evaluation and all, stops on training_finished
    return summary, tap, out


def check_evaluations(summary: dict, tap: StreamTap, out: Path, due: list[int], prompts: int) -> None:
    """Evaluated at exactly the due versions (the final one only if the actor saw it before training_finished),
    the events, evaluation.jsonl and the summary agreeing."""
    steps = summary["max_steps"]
    allowed = [due, [*due, steps]] if steps % EVERY == 0 else [due]
    assert summary["eval_versions"] in allowed, summary
    evaluations = [e for e in tap.events if e.type == protocol.EVALUATION]
    assert [e.payload["version"] for e in evaluations] == summary["eval_versions"]
    for e in evaluations:
        p = e.payload
        assert p["prompts"] == prompts and p["skipped"] == 0 and p["temperature"] == 0
        assert p["version"] <= p["model_version"] <= p["model_version_max"] <= steps
        assert 0 <= p["reward_mean"] <= 1
    lines = [json.loads(x) for x in (out / "evaluation.jsonl").read_text().splitlines()]
    assert [(x["version"], x["reward_mean"]) for x in lines] == [
        (e.payload["version"], e.payload["reward_mean"]) for e in evaluations]
    assert summary["eval_reward_last"] == lines[-1]["reward_mean"]
    assert (out / "reward.png").stat().st_size > 1000


def check_no_eval_prompt_trained(spec, tap: StreamTap, eval_set: list, pattern: str) -> set[str]:
    """No training document's prompt span (loss_masking_spans[0]) is an eval prompt as inference tokenizes the raw
    text; every span is checked to be such a prompt, so the comparison cannot pass vacuously. Returns the training
    prompts seen."""
    assert tap.complete, "the documents stream was not read after training_finished"
    tok = load_tokenizer(materialize_model(spec.model))
    held = {tuple(tok.encode(p.text)) for p in eval_set}
    assert len(tap.documents) >= spec.algorithm.max_steps * spec.algorithm.samples_per_step
    seen = set()
    for d in tap.documents:
        span = d.loss_masking_spans[0]
        assert span[0] == 0
        ids = tuple(int(t) for t in d.tokens[: span[1]])
        text = tok.decode(list(ids))
        assert re.fullmatch(pattern, text) and tuple(tok.encode(text)) == ids, text
        assert ids not in held, f"eval prompt {text!r} in a training document"
        seen.add(text)
    return seen


def test_eval_reward_every_n_versions_and_no_eval_prompt_in_training(tmp_path):
    doc = specs.document(**{"spec.algorithm.maxSteps": STEPS,
                            "spec.evaluation": {"everyVersions": EVERY, "prompts": PROMPTS}})
    summary, tap, out = run_job(tmp_path, doc)
    check_evaluations(summary, tap, out, [0, 4, 8], PROMPTS)
    spec = parse_spec(doc["spec"])
    eval_set = build_eval_set(spec, None)
    assert len(eval_set) == PROMPTS
    seen = check_no_eval_prompt_trained(spec, tap, eval_set, r"\d{1,2}:")
    # Training drew widely from the 110 prompts (the check above has something to check): 12 steps of 4 groups
    # draw about 38 distinct prompts on average; 29 was seen once, so the bound leaves room for chance.
    assert len(seen) >= 15


def test_multi_turn_episodes_are_evaluated_and_their_held_out_prompts_never_trained(tmp_path):
    """examples/calculator-cpu.yaml: the environment draws its own prompts (25 sums); the held-out ones are scored
    as whole episodes (calculator calls included) and never start a training episode."""
    doc = yaml.safe_load((ROOT / "examples" / "calculator-cpu.yaml").read_text())
    specs.with_overrides(doc, {"spec.algorithm.maxSteps": 8, "spec.evaluation": {"everyVersions": EVERY,
                                                                                  "prompts": PROMPTS}})
    summary, tap, out = run_job(tmp_path, doc)
    spec = parse_spec(doc["spec"])
    eval_set = build_eval_set(spec, load_environment(spec.task))
    assert 1 <= len(eval_set) < PROMPTS  # a small prompt space: the held-out part has fewer than asked
    check_evaluations(summary, tap, out, [0, 4], len(eval_set))
    seen = check_no_eval_prompt_trained(spec, tap, eval_set, r"\d+\+\d+=")
    assert len(seen) + len(eval_set) <= 25 and len(seen) >= 10


def test_an_eval_split_that_overlaps_training_fails_the_job_naming_the_field(tmp_path):
    """The actor checks the split against the training split at start and exits 78: the job fails at once with
    the field in its message, before any step is trained on prompts it would evaluate."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i:02d}:", "answer": f"{i:02d}"[::-1]}) + "\n"
                            for i in range(100)))
    doc = specs.document(**{"spec.algorithm.maxSteps": 5,
                            "spec.task.dataset": {"path": str(data), "split": "train[:60]"},
                            "spec.task.reward": {"type": "exact"},
                            "spec.evaluation": {"everyVersions": 2, "split": "train[50:]", "prompts": 20}})
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    summary, _ = run_local(manifest, tmp_path / "run", timeout=300, expect=1)
    assert summary["phase"] == "Failed" and summary["steps"] == 0, summary
    assert "spec.evaluation.split" in summary["message"], summary
    assert "10 of its 20 eval prompts are also in the training split" in summary["message"], summary
