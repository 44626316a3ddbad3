"""The model module: `materialize_model` for the three forms of spec.model.path (a directory, hf:// from a local
hub cache offline, builtin://), and every bad input raising a ModelError (a ConfigError) that names the field."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from support.hf_models import bpe_tokenizer, hub_cache, write_tiny_model
from rlkube.api.spec import ModelSpec
from rlkube.core.errors import ConfigError
from rlkube.core.hf import ModelError
from rlkube.core.hf.builtin import BOS_ID, CHARSET, EOS_ID
from rlkube.core.hf.loading import check_model_dir, load_model, load_tokenizer
from rlkube.core.hf.source import builtin_dir, materialize_model

OFFLINE = {"HF_HUB_OFFLINE": "1"}


def spec(path: str, **kw) -> ModelSpec:
    return ModelSpec(path=path, **kw)


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_builtin_is_written_once_deterministically_and_loads(tmp_path):
    a = materialize_model(spec("builtin://tiny-llama", seed=3), tmp_path / "a")
    b = materialize_model(spec("builtin://tiny-llama", seed=3), tmp_path / "b")
    assert a == builtin_dir("tiny-llama", 3, tmp_path / "a") and digest(a) == digest(b)  # same bytes anywhere
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert materialize_model(spec("builtin://tiny-llama", seed=3), tmp_path / "a") == a  # idempotent
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    assert not [p for p in a.parent.iterdir() if p.name.startswith(".tmp-")]
    other = materialize_model(spec("builtin://tiny-llama", seed=4), tmp_path / "a")
    assert digest(other)["model.safetensors"] != digest(a)["model.safetensors"]  # the seed decides the weights

    model = load_model(a)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert cfg.head_dim >= 32 and cfg.hidden_size == cfg.num_attention_heads * cfg.head_dim  # vLLM can serve it
    tok = load_tokenizer(a, cfg)
    assert tok.encode("12:") == [BOS_ID, *(4 + CHARSET.index(c) for c in "12:")]
    assert tok.decode(tok.encode("21 ab") + [EOS_ID]) == "21 ab" and tok.eos_ids == (EOS_ID,)
    assert tok.apply_chat_template([{"role": "user", "content": "12:"}]) == "<bos>12:"


def test_a_directory_is_checked_and_returned_as_it_is(tmp_path):
    d = write_tiny_model(tmp_path / "m", "qwen3", "bpe")
    assert materialize_model(spec(str(d)), tmp_path / "cache") == d
    assert not (tmp_path / "cache").exists()  # nothing copied


def test_hf_path_resolves_to_the_cached_snapshot_offline(tmp_path):
    cache = tmp_path / "cache"
    main = hub_cache(cache, "acme/tiny-qwen2", write_tiny_model(tmp_path / "m1", "qwen2", "bpe"))
    tagged = hub_cache(cache, "acme/tiny-qwen2", write_tiny_model(tmp_path / "m2", "qwen2", "bpe", seed=1), "v1")
    got = materialize_model(spec("hf://acme/tiny-qwen2"), cache, env=OFFLINE)
    assert got.name == main and got.parent.name == "snapshots"
    assert materialize_model(spec("hf://acme/tiny-qwen2@v1"), cache, env=OFFLINE).name == tagged
    assert materialize_model(spec(f"hf://acme/tiny-qwen2@{main}"), cache, env=OFFLINE).name == main
    model = load_model(got)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # tied, as the config says

    with pytest.raises(ModelError, match=r"spec\.model\.path: hf://acme/absent: HF_HUB_OFFLINE is set and no"):
        materialize_model(spec("hf://acme/absent"), cache, env=OFFLINE)
    with pytest.raises(ModelError, match="spec.model.path"):
        materialize_model(spec("hf://acme/tiny-qwen2@v2"), cache, env=OFFLINE)


def broken(tmp_path: Path, how: str) -> Path:
    d = write_tiny_model(tmp_path / how, "llama", "char")
    if how == "no-config":
        (d / "config.json").unlink()
    elif how == "bad-json":
        (d / "config.json").write_text("{not json")
    elif how == "unsupported":
        cfg = json.loads((d / "config.json").read_text())
        cfg["architectures"] = ["GPT2LMHeadModel"]
        (d / "config.json").write_text(json.dumps(cfg))
    elif how == "no-weights":
        (d / "model.safetensors").unlink()
    elif how == "file":
        shutil.rmtree(d)
        d.write_text("not a directory")
    elif how == "missing":
        shutil.rmtree(d)
    return d


@pytest.mark.parametrize(("how", "says"), [
    ("missing", "does not exist"),
    ("file", "is not a directory"),
    ("no-config", "has no config.json"),
    ("bad-json", "is not valid JSON"),
    ("unsupported", "architecture 'GPT2LMHeadModel' .* is not supported .*LlamaForCausalLM, Qwen2ForCausalLM"),
    ("no-weights", "has no safetensors weights"),
])
def test_bad_directories_name_the_field(tmp_path, how, says):
    d = broken(tmp_path, how)
    with pytest.raises(ModelError, match=rf"^spec\.model\.path: .*{says}") as err:
        materialize_model(spec(str(d)), tmp_path / "cache")
    assert isinstance(err.value, ConfigError) and err.value.field == "spec.model.path"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_unreadable_directory_names_the_field(tmp_path):
    d = write_tiny_model(tmp_path / "m", "llama", "char")
    d.chmod(0)
    try:
        with pytest.raises(ModelError, match="not readable"):
            check_model_dir(d)
    finally:
        d.chmod(0o755)


def test_tokenizer_that_does_not_match_the_model_is_refused(tmp_path):
    d = write_tiny_model(tmp_path / "m", "llama", "char")  # 64 embedding rows
    bpe_tokenizer().save_pretrained(str(d))  # 300 tokens: ids the embedding has no row for
    with pytest.raises(ModelError, match=r"spec\.model\.path: the tokenizer .* has 300 tokens but the model's "
                                         r"embedding has 64 rows"):
        load_tokenizer(d)


def test_tokenizer_without_eos_is_refused(tmp_path):
    d = write_tiny_model(tmp_path / "m", "llama", "char")
    config = json.loads((d / "tokenizer_config.json").read_text())
    config.pop("eos_token")
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "generation_config.json").unlink()
    with pytest.raises(ModelError, match="no end-of-sequence token"):
        load_tokenizer(d)


@pytest.mark.parametrize("path", ["builtin://tiny-gpt", "hf://only-a-name", "s3://bucket/model"])
def test_malformed_paths_name_the_field(tmp_path, path):
    with pytest.raises(ModelError, match=r"^spec\.model\.path: "):
        materialize_model(spec(path), tmp_path)


def test_a_sequence_limit_beyond_the_models_positions_names_its_field(tmp_path):
    from rlkube.lifecycle.validation import parse_spec
    from rlkube.core.trainer import Trainer

    d = write_tiny_model(tmp_path / "m", "qwen3", "bpe")  # max_position_embeddings 256
    spec = parse_spec({"model": {"path": str(d), "maxSequenceLength": 512}, "algorithm": {"maxSteps": 1},
                       "inference": {"engine": "native"}})
    with pytest.raises(ModelError, match=r"^spec\.model\.maxSequenceLength: 512 exceeds .* \(256\)"):
        Trainer(spec)
