"""Atomic checkpoints: complete-or-invisible directories, latest-by-scan, pruning, strict loading."""

import json

import pytest
import torch

from rlkube.core.training import checkpoint as ckpt


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def _save(root, step, model=None, opt=None):
    model = model or _model(step)
    opt = opt or torch.optim.Adam(model.parameters())
    return ckpt.save_checkpoint(root, ckpt.CheckpointMeta(step=step, documents_seen=10 * step, weights_version=step),
                                model.state_dict(), opt.state_dict())


def test_save_then_load_round_trip(tmp_path):
    model = _model(1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    path = _save(tmp_path, 5, model, opt)
    assert path.name == "step-000005"
    assert sorted(p.name for p in path.iterdir()) == sorted([ckpt.MODEL_FILE, *ckpt.REQUIRED_FILES])
    other = _model(2)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.1)
    meta = ckpt.load_checkpoint(path, other, other_opt)
    assert (meta.step, meta.documents_seen, meta.weights_version) == (5, 50, 5)
    for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert other_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_latest_ignores_incomplete_and_torn_directories(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    # a writer killed mid-way leaves a temp dir; a directory with the right name but a missing file is torn
    (tmp_path / ".tmp-step-000009-abc").mkdir()
    torn = tmp_path / "step-000007"
    torn.mkdir()
    (torn / ckpt.MODEL_FILE).write_bytes(b"partial")
    bad_meta = tmp_path / "step-000008"
    bad_meta.mkdir()
    for name in (ckpt.MODEL_FILE, *ckpt.REQUIRED_FILES):
        (bad_meta / name).write_text("{")
    mismatch = _save(tmp_path / "elsewhere", 3)
    mismatch.rename(tmp_path / "step-000006")  # meta says step 3
    assert ckpt.latest_checkpoint(tmp_path).name == "step-000002"


def test_keeps_the_last_two(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000004"]


def test_pruning_removes_a_sharded_trainers_distributed_checkpoint_with_its_step(tmp_path):
    """An FSDP trainer writes shards-N (torch.distributed.checkpoint) before step-N; they go together."""
    for step in (1, 2, 3):
        (tmp_path / ckpt.shards_name(step)).mkdir()
        (tmp_path / ckpt.shards_name(step) / "__0_0.distcp").write_bytes(b"x")
        _save(tmp_path, step)
    assert ckpt.latest_checkpoint(tmp_path).name == "step-000003"  # a shards directory is never a checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards-000002", "shards-000003", "step-000002",
                                                          "step-000003"]


def test_resaving_a_step_replaces_it(tmp_path):
    _save(tmp_path, 3, _model(1))
    path = _save(tmp_path, 3, _model(2))
    state = ckpt.load_file(str(path / ckpt.MODEL_FILE))
    assert torch.equal(state["0.weight"], _model(2).state_dict()["0.weight"])
    assert json.loads((path / ckpt.META_FILE).read_text())["step"] == 3


def test_strict_load_rejects_missing_keys(tmp_path):
    path = _save(tmp_path, 1)
    bigger = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="Missing key"):
        ckpt.load_checkpoint(path, bigger)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(tmp_path / "step-000099", _model())


def test_failed_save_leaves_nothing_visible(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise TypeError("cannot pickle this")

    with pytest.raises(TypeError):
        ckpt.save_checkpoint(tmp_path, ckpt.CheckpointMeta(step=1), _model().state_dict(), {"x": Unpicklable()})
    assert list(tmp_path.iterdir()) == []
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_checkpoint_of_a_hf_model_is_a_hf_directory(tmp_path):
    """config, tokenizer, generation config and chat template come from the model directory (config.json with the
    job's dtype); transformers loads the checkpoint as it is and gets the saved weights."""
    from support.hf_models import builtin_dir
    from rlkube.core.hf import state as hf_state
    from rlkube.core.hf.loading import load_model, load_tokenizer

    source = builtin_dir()
    model = load_model(source)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # something the source directory does not hold
    path = ckpt.save_checkpoint(tmp_path, ckpt.CheckpointMeta(step=1), hf_state.named_weights(model), {},
                                model_dir=source, dtype="bfloat16")
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", ckpt.MODEL_FILE, ckpt.OPTIMIZER_FILE, ckpt.META_FILE} <= names
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (path / name).read_bytes() == (source / name).read_bytes()
    loaded = load_model(path, torch.float32)
    for name, tensor in hf_state.named_weights(model).items():
        assert torch.equal(hf_state.named_weights(loaded)[name], tensor), name
    assert load_tokenizer(path).encode("12:") == load_tokenizer(source).encode("12:")


def test_sharded_weights_count_as_complete_only_with_every_shard(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "MAX_SHARD_SIZE", 100)  # bytes: every tensor in a shard of its own
    path = _save(tmp_path, 1)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) > 1 and (path / ckpt.INDEX_FILE).is_file() and not (path / ckpt.MODEL_FILE).exists()
    other = _model(2)
    ckpt.load_checkpoint(path, other)
    for a, b in zip(_model(1).state_dict().values(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    (path / shards[0]).unlink()
    assert ckpt.latest_checkpoint(tmp_path) is None
