"""`python -m rlkube.bench.gpu_smoke [--cpu] [--out FILE]`: the smoke check of the training core on one GPU.

Why it exists: this repository is built and tested on machines without a GPU (README, "Tests"), so the
CUDA side of the core (NCCL, bfloat16 autocast, FSDP2 on CUDA, the native engine's KV cache on CUDA) is code
that no test tier runs. This module runs that code once, in a few minutes, the first time a GPU is at hand,
and says in one JSON line whether it works and what it costs. Nothing shipped imports it (the bench package is
the top floor, tests/unit/test_layering.py), and no test tier runs it on a GPU; `--cpu` runs the same steps in
float32 at tiny sizes, which is what tests/unit/test_gpu_smoke.py does so that it cannot rot.

What it runs, through the project's own code paths (nothing here re-implements them):
1. a random Qwen2-shaped Hugging Face model (Qwen2's vocabulary of 151936 rows, a small decoder) with the
   built-in character tokenizer (rlkube.core.hf.builtin), written to a temp directory;
2. a one-rank trainer process group as the trainer role forms it (rlkube.core.backends.torch_distributed:
   NCCL on CUDA, gloo with --cpu), and the `torch` backend sharded with FSDP2 (`trainer.sharding: fsdp`,
   rlkube.core.backends.torch_fsdp) in `model.dtype` bfloat16 (float32 with --cpu), behind the Trainer API
   (rlkube.core.trainer.Trainer: forward_backward / optim_step / save_checkpoint / publish_weights);
3. the native inference engine (rlkube.core.inference.sampling.SamplingEngine behind rlkube.core.inference's HTTP
   server, the model in the served dtype on the same device), which takes the trainer's weights by an in-process
   update: the trainer publishes them exactly as it does for inference servers (the FSDP weight stream of
   rlkube.core.weights in the transfer dtype, bucket by bucket, with its checksum), and the engine's
   WeightFollower loads them as it does an update received over the weight-sync group. The group itself
   (NCCL between two processes) needs a GPU per side, so this one-GPU check does not cross it;
4. a PipelineRL-shaped loop: the engine samples groups of completions over HTTP (`/v1/completions`, with
   log-probs), which become training documents (the engine's log-probs as the sampling log-probs,
   group-relative advantages of a made-up reward), and the trainer takes N steps on them
   (forward_backward / optim_step), measuring tokens/s and the peak GPU memory of one forward_backward;
5. a checkpoint (distributed shards + Hugging Face export, rlkube.core.training.checkpoint) resumed by a second trainer
   from the job's directory: the same weights, bit for bit, and the same Adam state;
6. the trained weights published to the engine (version N), completions sampled from it, and their log-probs
   compared with the trainer's own for the same tokens (max abs difference, within LOGPROB_TOLERANCE);
7. the engine's generation throughput (tokens/s, one batch of many rows).

The last stdout line is one JSON object (also written to --out): device, versions, loss_first/loss_last,
ratio_mean_first (trainer vs engine log-probs through the importance ratio, on the sampled documents),
train_tokens_per_s, engine_tokens_per_s, logprob_max_abs_diff, checkpoint_roundtrip_ok, loss_peak_mem_bytes,
fsdp_world_size, wall_s, checks (each check by name) and ok. The exit status is 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import platform
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from rlkube.bench.in_process_engine import EngineClient, InProcessPublisher, InProcessReceiver
from rlkube.local.ports import free_port

log = logging.getLogger("rlkube.gpu_smoke")

QWEN2_VOCAB = 151936  # Qwen2's embedding rows (Qwen2-0.5B ... 72B)
# Max |engine log-prob - trainer log-prob| over the compared tokens. bfloat16: the engine computes everything
# in bfloat16 (weights, activations, LM head), the trainer runs its decoder under bfloat16 autocast over float32
# masters and its LM head and log-softmax in float32 (rlkube.core.backends.torch_backend); float32: both sides
# compute the same float32 math in other kernel orders (prefill + KV cache vs one causal forward).
LOGPROB_TOLERANCE = {"bfloat16": 0.1, "float32": 1e-3}
# The mean of the same differences: a systematic mismatch (a wrong scale, the wrong weights) shows here first.
LOGPROB_MEAN_TOLERANCE = {"bfloat16": 0.02, "float32": 1e-4}


# --- sizes ---------------------------------------------------------------------------------------------------

GPU_SIZES = dict(hidden=512, intermediate=1408, layers=4, heads=8, kv_heads=2, prompts=16, group=4, prompt_len=32,
                 new_tokens=96, steps=12, micro_batch_tokens=4096, engine_rows=128, engine_new_tokens=128,
                 max_len=512)
CPU_SIZES = dict(hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, prompts=4, group=4, prompt_len=8,
                 new_tokens=12, steps=4, micro_batch_tokens=256, engine_rows=8, engine_new_tokens=16, max_len=64)


def write_model(directory: Path, vocab: int, sizes: dict[str, int], seed: int) -> Path:
    """A random Qwen2ForCausalLM (tied embeddings, grouped-query attention) + the built-in character tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    from rlkube.core.hf.builtin import BOS_ID, EOS_ID, PAD_ID, char_tokenizer

    hf_logging.disable_progress_bar()
    tokenizer = char_tokenizer()
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=sizes["hidden"], intermediate_size=sizes["intermediate"],
        num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"],
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, architectures=["Qwen2ForCausalLM"],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def job_spec(model_dir: Path, dtype: str, sizes: dict[str, int], lr: float, cuda: bool):
    """The TrainingJob spec of the smoke: validated as a manifest's is, then switched to FSDP. Validation refuses
    `sharding: fsdp` on one rank (it shards over ranks); one rank is exactly what this check runs on purpose."""
    from rlkube.lifecycle.validation import parse_spec

    spec = parse_spec({
        "model": {"path": str(model_dir), "dtype": dtype, "maxSequenceLength": sizes["max_len"]},
        "algorithm": {"maxSteps": sizes["steps"] + 1, "samplesPerStep": sizes["prompts"] * sizes["group"],
                      "groupSize": sizes["group"], "learningRate": lr, "loss": "grpo",
                      "maxNewTokens": sizes["new_tokens"]},
        "trainer": {"gpusPerNode": 1 if cuda else 0, "microBatchTokens": sizes["micro_batch_tokens"],
                    "weightTransfer": {"dtype": "auto"}},
        "inference": {"engine": "native"},
    })
    return spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"sharding": "fsdp"})})


# --- helpers -----------------------------------------------------------------------------------------------


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reward(token_ids: list[int]) -> float:
    """A made-up reward for the smoke's rollouts: the share of even token ids (any deterministic score will do:
    what matters is that groups have spread, so advantages are not all zero)."""
    return sum(1 for t in token_ids if t % 2 == 0) / max(len(token_ids), 1)


def rollouts_to_documents(responses: list[dict], version: int):
    """Each prompt's group of completions as training documents, as the preprocessor builds them: prompt
    excluded from the loss, the engine's sampling log-probs, group-relative advantages (leave-one-out)."""
    import numpy as np

    from rlkube.contract import protocol
    from rlkube.core.preprocessor.advantages import leave_one_out

    docs = []
    for resp in responses:
        choices = [c for c in resp["choices"] if c["token_ids"]]
        rewards = [_reward(c["token_ids"]) for c in choices]
        for c, adv in zip(choices, leave_one_out(rewards), strict=True):
            prompt, completion = c["prompt_token_ids"], c["token_ids"]
            tokens = np.array(prompt + completion, dtype=np.int64)
            old = np.zeros(len(tokens), dtype=np.float32)
            old[len(prompt):] = c["logprobs"]["token_logprobs"]
            docs.append(protocol.Document(tokens, [(0, len(prompt))], advantage=float(adv),
                                          reward=_reward(completion), old_log_probabilities=old,
                                          model_version=np.full(len(tokens), version, dtype=np.int64)))
    return docs


def trainer_logprobs(trainer, rows: list[list[int]]):
    """The trainer's log-probs of each row's tokens 1.. (what its loss uses: rlkube.core.training.losses.token_logprobs
    of the backend's logits at the job's temperature), one list per row."""
    import torch

    from rlkube.core.training.losses import token_logprobs

    backend = trainer.backend
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), backend.pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.tensor(r)
    tokens = tokens.to(backend.device)
    with torch.no_grad():
        logp = token_logprobs(backend.logits(tokens), tokens, backend.temperature).float().cpu()
    return [logp[i, :len(r) - 1].tolist() for i, r in enumerate(rows)]


def compare_logprobs(trainer, responses: list[dict]) -> dict[str, float]:
    """Engine log-probs of sampled tokens vs the trainer's for the same tokens."""
    rows, engine = [], []
    for resp in responses:
        for c in resp["choices"]:
            if c["token_ids"]:
                rows.append(c["prompt_token_ids"] + c["token_ids"])
                engine.append((len(c["prompt_token_ids"]), c["logprobs"]["token_logprobs"]))
    mine = trainer_logprobs(trainer, rows)
    diffs = []
    for (plen, theirs), ours in zip(engine, mine, strict=True):
        # the completion's token k is row index plen + k, predicted at position plen + k - 1
        diffs += [abs(a - b) for a, b in zip(theirs, ours[plen - 1:], strict=True)]
    return {"max": max(diffs), "mean": sum(diffs) / len(diffs), "tokens": len(diffs)}


def weights_equal(a, b) -> bool:
    import torch

    left, right = dict(a), dict(b)
    return left.keys() == right.keys() and all(torch.equal(left[k].cpu(), right[k].cpu()) for k in left)


def optimizer_states_equal(a, b) -> bool:
    """Adam's state of two sharded backends, tensor by tensor (the shards, which are whole at world size 1)."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    pa, pb = list(a.model.parameters()), list(b.model.parameters())
    if len(pa) != len(pb):
        return False
    for p, q in zip(pa, pb, strict=True):
        sa, sb = a.optimizer.state.get(p, {}), b.optimizer.state.get(q, {})
        if sa.keys() != sb.keys():
            return False
        for k in sa:
            x, y = sa[k], sb[k]
            if isinstance(x, torch.Tensor):
                if not torch.equal(local(x).cpu(), local(y).cpu()):
                    return False
            elif x != y:
                return False
    return a.scheduler.state_dict() == b.scheduler.state_dict()


# --- the check -------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, work: Path, result: dict[str, Any]) -> None:
    import torch
    import transformers

    from rlkube.core.training import checkpoint as ckpt
    from rlkube.core.backends.torch_distributed import DataParallel, DistConfig
    from rlkube.core.hf.loading import load_model, load_tokenizer
    from rlkube.core.inference.native_engine import NativeEngine
    from rlkube.core.inference.shell import InferenceServer, WeightFollower
    from rlkube.core.inference.openai_api import ServedModel
    from rlkube.core.inference.sampling import SamplingEngine
    from rlkube.core.trainer import Trainer

    checks: dict[str, bool] = result["checks"]
    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (torch.cuda.is_available() is False); use --cpu for the CPU variant")
    sizes = dict(CPU_SIZES if args.cpu else GPU_SIZES)
    if args.steps:
        sizes["steps"] = args.steps
    dtype = args.dtype or ("float32" if args.cpu else "bfloat16")
    vocab = args.vocab or (512 if args.cpu else QWEN2_VOCAB)
    if cuda:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        result["device"] = torch.cuda.get_device_name(device)
    else:
        device = torch.device("cpu")
        result["device"] = f"cpu ({platform.processor() or platform.machine()})"
    result.update(torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__,
                  python=platform.python_version(), dtype=dtype, vocab=vocab, sizes=sizes)

    t = time.monotonic()
    model_dir = write_model(work / "model", vocab, sizes, args.seed)
    result["model_write_s"] = round(time.monotonic() - t, 2)
    log.info("model written (%s, vocab %d, %s) in %.1fs", dtype, vocab, sizes, result["model_write_s"])
    spec = job_spec(model_dir, dtype, sizes, args.lr, cuda)

    # The trainer's process group, as the trainer role forms it for more than one rank (build_role): its own
    # TCPStore, NCCL on CUDA, gloo on CPU. FSDP2 shards over it (here: one rank holds every shard).
    dp = DataParallel(DistConfig(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port()),
                      device=str(device))
    try:
        result["dist_backend"] = dp.backend
        t = time.monotonic()
        trainer = Trainer(spec, checkpoint_dir=work / "checkpoints", device=str(device), dp=dp, model_dir=model_dir)
        result["trainer_build_s"] = round(time.monotonic() - t, 2)
        result["fsdp_world_size"] = torch.distributed.get_world_size()
        result["backend"] = type(trainer.backend).__name__
        checks["fsdp_sharded"] = trainer.sharded and result["backend"] == "FSDPTorchBackend"
        result["parameters"] = sum(p.numel() for p in trainer.model.parameters())
        log.info("trainer built: %s over %s, %d parameters, in %.1fs", result["backend"], dp.backend,
                 result["parameters"], result["trainer_build_s"])

        # The engine, as the inference role builds it (native_engine.open_engine), but on this device.
        served_model = load_model(model_dir, dtype, device)
        tokenizer = load_tokenizer(model_dir, served_model.config)
        engine = SamplingEngine(served_model, tokenizer, version=0, seed=args.seed)
        served = ServedModel(spec.model.path, tokenizer, spec.model.max_sequence_length)
        native = NativeEngine(engine, InProcessReceiver(), copy.deepcopy(served_model), served)
        follower = WeightFollower(None, spec_keys(), native)
        trainer.publisher = InProcessPublisher(follower)
        engine.start()
        with EngineClient(InferenceServer(native, follower)) as http:
            status, _ = http.health()
            checks["health_503_before_update"] = status == 503
            trainer.start_weights()  # version 0, as the trainer role does at start-up
            status, health = http.health()
            checks["health_200_after_update"] = status == 200 and health["model_version"] == 0

            # Rollouts of version 0 -> documents -> N steps through the Trainer API.
            rng = random.Random(args.seed)
            letters = "0123456789abcdefghijklmnopqrstuvwxyz"
            prompts = [tokenizer.encode("".join(rng.choice(letters) for _ in range(sizes["prompt_len"] - 1)))
                       for _ in range(sizes["prompts"])]

            def sample(seed: int, n: int, max_tokens: int) -> list[dict]:
                """One request per prompt: n completions each, with the sampled tokens' log-probs."""
                body = {"n": n, "max_tokens": max_tokens, "temperature": spec.algorithm.temperature, "logprobs": 0}
                return [http.complete({**body, "prompt": p, "seed": seed + i}) for i, p in enumerate(prompts)]

            responses = sample(1000, sizes["group"], sizes["new_tokens"])
            docs = rollouts_to_documents(responses, version=0)
            result["documents"] = len(docs)
            log.info("sampled %d documents of version 0", len(docs))
            step_tokens = sum(len(d.tokens) for d in docs)
            result["tokens_per_step"] = step_tokens
            losses, step_s, metrics = [], [], []
            result["loss_peak_mem_bytes"] = None  # CUDA only: torch.cuda.max_memory_allocated
            for step in range(sizes["steps"]):
                _sync(device)
                t0 = time.monotonic()
                if step == 0 and cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                    before = torch.cuda.memory_allocated(device)
                stats = trainer.forward_backward(docs)  # every micro-batch, normalised by the step's loss tokens
                if step == 0 and cuda:
                    _sync(device)
                    result["loss_peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
                    result["loss_peak_mem_above_start_bytes"] = result["loss_peak_mem_bytes"] - before
                m = trainer.optim_step()
                _sync(device)
                step_s.append(time.monotonic() - t0)
                losses.append(m["loss"])
                metrics.append({"loss": m["loss"], "ratio_mean": m["ratio_mean"], "grad_norm": m["grad_norm"],
                                "clipped_fraction": m["clipped_fraction"], "s": round(step_s[-1], 4)})
                if step == 0:
                    result["ratio_mean_first"] = stats["ratio_mean"]
                log.info("step %d: %s", step + 1, metrics[-1])
            result.update(steps=len(losses), loss_first=losses[0], loss_last=losses[-1], step_metrics=metrics)
            timed = step_s[1:] or step_s  # the first step warms up (kernels, Adam's state)
            result["train_tokens_per_s"] = round(step_tokens * len(timed) / sum(timed), 1)
            result["train_step_s_median"] = round(sorted(timed)[len(timed) // 2], 4)
            if cuda:
                result["train_peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
            checks["loss_finite"] = all(math.isfinite(x) for x in losses)
            checks["loss_decreased"] = losses[-1] < losses[0]
            checks["grad_norm_finite"] = all(math.isfinite(m["grad_norm"]) for m in metrics)
            # Before the first step the trainer's policy is the one that sampled: the importance ratio is 1 up
            # to the engine's and the trainer's numerics.
            checks["ratio_mean_first_near_1"] = abs(result["ratio_mean_first"] - 1.0) < 0.05

            # Checkpoint (distributed shards + HF export), then a second trainer resumes it.
            t0 = time.monotonic()
            path = trainer.save_checkpoint()
            result["checkpoint_save_s"] = round(time.monotonic() - t0, 2)
            result["checkpoint"] = str(path)
            exported = ckpt.load_weights(path)
            final = [(n, w.detach().cpu().clone()) for n, w in trainer.backend.weights()]
            checks["checkpoint_hf_export_matches"] = weights_equal(exported.items(), final)
            config = json.loads((path / ckpt.CONFIG_FILE).read_text())
            checks["checkpoint_config_dtype"] = config.get("dtype", config.get("torch_dtype")) == dtype
            t0 = time.monotonic()
            resumed = Trainer(spec, checkpoint_dir=work / "checkpoints", device=str(device), dp=dp,
                              model_dir=model_dir)
            resumed_from = resumed.resume()
            result["checkpoint_load_s"] = round(time.monotonic() - t0, 2)
            same_weights = weights_equal(resumed.backend.weights(), final)
            same_optimizer = optimizer_states_equal(trainer.backend, resumed.backend)
            log.info("checkpoint %s saved in %.1fs and resumed in %.1fs", path, result["checkpoint_save_s"],
                     result["checkpoint_load_s"])
            result["checkpoint_roundtrip_ok"] = bool(
                resumed_from == path and resumed.step == trainer.step and same_weights and same_optimizer)
            result["checkpoint_same_weights"], result["checkpoint_same_optimizer"] = same_weights, same_optimizer
            checks["checkpoint_roundtrip"] = result["checkpoint_roundtrip_ok"]
            del resumed, exported
            if cuda:
                torch.cuda.empty_cache()

            # The trained weights to the engine (version N), then its log-probs against the trainer's.
            t0 = time.monotonic()
            trainer.publish_weights(trainer.version)
            result["weight_update_s"] = round(time.monotonic() - t0, 3)
            result["weight_update_bytes"] = trainer.publisher.bytes // max(trainer.publisher.updates, 1)
            status, health = http.health()
            checks["engine_serves_version_n"] = status == 200 and health["model_version"] == trainer.version
            served_on = {p.device.type for p in engine.policy.model.parameters()}
            checks["engine_on_device"] = served_on == {device.type}
            from rlkube.core.hf.loading import DTYPES
            from rlkube.core.weights.wire import checksums_match, transfer_dtype, weights_checksum

            # What the engine holds: the masters in the transfer dtype, converted to the served dtype; its
            # checksum (in the transfer dtype) equals the trainer's whenever the served dtype holds the transfer
            # dtype exactly (rlkube.core.weights), as bfloat16 does on CUDA.
            sent = transfer_dtype(spec.trainer.weight_transfer.dtype, spec.model.dtype)
            held = weights_checksum((n, w.to(sent).to(DTYPES[dtype]).to(sent)) for n, w in final)
            result["weight_transfer_dtype"] = str(sent).removeprefix("torch.")
            checks["engine_checksum_matches_trainer"] = checksums_match(float(health["weights_checksum"]), held)
            responses = sample(2000, sizes["group"], sizes["new_tokens"])
            checks["completions_of_version_n"] = all(r["model_version"] == trainer.version for r in responses)
            diff = compare_logprobs(trainer, responses)
            result["logprob_max_abs_diff"] = diff["max"]
            result["logprob_mean_abs_diff"] = diff["mean"]
            result["logprob_tokens_compared"] = diff["tokens"]
            result["logprob_tolerance"] = LOGPROB_TOLERANCE[dtype]
            log.info("log-probs engine vs trainer over %d tokens: max abs diff %.3g, mean %.3g", diff["tokens"],
                     diff["max"], diff["mean"])
            checks["logprobs_within_tolerance"] = (diff["max"] <= LOGPROB_TOLERANCE[dtype]
                                                   and diff["mean"] <= LOGPROB_MEAN_TOLERANCE[dtype])

            # Generation throughput: one batch of many rows (a warm-up batch first), no log-probs returned.
            body = {"prompt": prompts[0], "n": sizes["engine_rows"], "max_tokens": sizes["engine_new_tokens"],
                    "temperature": 1.0, "seed": 7}
            http.complete({**body, "n": 2, "max_tokens": 4})
            _sync(device)
            t0 = time.monotonic()
            out = http.complete(body)
            _sync(device)
            elapsed = time.monotonic() - t0
            generated = out["usage"]["completion_tokens"]
            result["engine_tokens_per_s"] = round(generated / elapsed, 1)
            result["engine_batch"] = {"rows": sizes["engine_rows"], "tokens": generated, "s": round(elapsed, 3)}
            checks["engine_generated"] = generated > 0
            log.info("engine: %d tokens in %.2fs", generated, elapsed)
        engine.stop(5.0)
        if cuda:
            result["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
        dp.finish()
    finally:
        dp.close()


def spec_keys():
    from rlkube.contract.protocol import StreamKeys

    return StreamKeys.for_job("smoke", "gpu-smoke")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlkube.bench.gpu_smoke", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on CPU (gloo, float32, tiny sizes) instead of CUDA")
    p.add_argument("--out", type=Path, help="also write the JSON result to this file")
    p.add_argument("--vocab", type=int, help=f"embedding rows (default {QWEN2_VOCAB}; 512 with --cpu)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"),
                   help="spec.model.dtype (default bfloat16 on CUDA, float32 with --cpu)")
    p.add_argument("--steps", type=int, help="training steps (default 12; 4 with --cpu)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temp directory)")
    p.add_argument("--timeout", type=float, default=450.0,
                   help="after this many seconds, print every thread's stack and exit 1 (a hang, e.g. in NCCL)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rlkube.core.hf.builtin import CHARSET, SPECIALS  # no torch: a bad argument fails in a second

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s gpu-smoke %(name)s %(levelname)s %(message)s")
    started = time.monotonic()
    result: dict[str, Any] = {"ok": False, "checks": {}, "device": None}
    if args.timeout > 0:
        import faulthandler

        faulthandler.dump_traceback_later(args.timeout, exit=True)  # stacks to stderr, exit 1: no JSON line
    try:
        tokens = len(SPECIALS) + len(CHARSET)
        if args.vocab is not None and args.vocab < tokens:
            raise SystemExit(f"--vocab {args.vocab}: the character tokenizer alone has {tokens} tokens")
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            run(args, args.keep, result)
        else:
            with tempfile.TemporaryDirectory(prefix="rlkube-gpu-smoke-") as tmp:
                run(args, Path(tmp), result)
        result["ok"] = bool(result["checks"]) and all(result["checks"].values())
    except BaseException as exc:  # noqa: BLE001 - reported in the JSON line, and the exit status says so
        if isinstance(exc, SystemExit):
            print(exc, file=sys.stderr)
        else:
            traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["failed"] = sorted(k for k, v in result["checks"].items() if not v)
    result["wall_s"] = round(time.monotonic() - started, 2)
    return emit(result, args.out)


def emit(result: dict, out: Path | None) -> int:
    """The check's one JSON line, on stdout and in `out` (--out); the exit status says whether it passed."""
    line = json.dumps(result, default=str)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(line + "\n")
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    code = main()
    # torch.distributed and transformers loaded: the interpreter's own teardown adds seconds for nothing (as the
    # trainer role does, rlkube.core.trainer.main).
    logging.shutdown()
    os._exit(code)
