"""save_model / save_pretrained of a managed model load with from_pretrained, same logits."""

import json

import safetensors.torch
import tierwise
import torch
import transformers
from helpers.models import tiny_model
from hf_helpers import TokenBlocks, logits_of, run_tierwise, tiny_tokenizer, training_args

IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))


def _weights(folder):
    files = sorted(folder.glob("*.safetensors"))
    assert files
    out = {}
    for file in files:
        out.update(safetensors.torch.load_file(file))
    return out


def test_save_model_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path):
    tokenizer = tiny_tokenizer()
    trainer = run_tierwise(
        "qwen2",
        training_args(tmp_path / "run"),
        TokenBlocks(),
        processing_class=tokenizer,
        data_collator=transformers.default_data_collator,
    )
    trainer.save_model(str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "float32"
    assert all(v.dtype == torch.float32 for v in _weights(tmp_path / "out").values())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    )
    assert torch.equal(logits_of(loaded, IDS), logits_of(trainer.model, IDS))
    reloaded_tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "out")
    assert reloaded_tokenizer.get_vocab() == tokenizer.get_vocab()


def test_save_model_writes_shards_of_at_most_the_shard_size(tmp_path, monkeypatch):
    from tierwise.integrations import hf

    assert hf.MAX_SHARD_SIZE == "5GB"  # the largest shard save_model writes
    monkeypatch.setattr(hf, "MAX_SHARD_SIZE", "20KB")  # the same path, at a size tiny shards show
    trainer = run_tierwise("llama", training_args(tmp_path / "run", max_steps=2), TokenBlocks())
    trainer.save_model(str(tmp_path / "out"))
    files = sorted((tmp_path / "out").glob("model-*-of-*.safetensors"))
    assert len(files) > 2 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    biggest = max(v.numel() * v.element_size() for v in trainer.model.state_dict().values())
    assert all(f.stat().st_size <= max(20_000, biggest) + 4096 for f in files)  # + header
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    )
    assert torch.equal(logits_of(loaded, IDS), logits_of(trainer.model, IDS))


def test_save_model_in_bf16_says_so(tmp_path):
    from tierwise.integrations.hf import TierwiseTrainer

    model = tiny_model("llama")
    trainer = TierwiseTrainer(
        model=model,
        args=training_args(tmp_path / "run", max_steps=2),
        train_dataset=TokenBlocks(),
        save_dtype="bf16",
        tierwise_config={"chunk_size": 2048},
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    weights = _weights(tmp_path / "out")
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    masters = trainer.model.state_dict()
    assert all(torch.equal(weights[k], masters[k].to(torch.bfloat16)) for k in weights)


def test_save_pretrained_of_a_bf16_run_records_the_fp32_it_writes(tmp_path):
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(model, opt, precision="bf16", device="cpu", chunk_size=2048)
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    opt.step()
    model.zero_grad()
    model.save_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"
    weights = _weights(tmp_path / "out")
    masters = model.state_dict()
    assert all(v.dtype == torch.float32 and torch.equal(v, masters[k]) for k, v in weights.items())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    )
    assert loaded.dtype == torch.float32


def _save_pretrained_on_ranks(rank, world, root):
    import os

    os.chdir(root / f"cwd-rank{rank}")  # "out" below is one argument, a folder per rank
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(model, opt, precision="bf16", device="cpu", chunk_size=2048)
    model(input_ids=IDS, labels=IDS).loss.backward()
    opt.step()
    model.zero_grad()
    model.save_pretrained("out")  # every rank: the gather is collective, rank 0 writes
    return {"state": model.state_dict()}


def test_save_pretrained_on_every_rank_writes_once_from_rank_0(tmp_path):
    """Both ranks call ``save_pretrained("out")``, each from its own working directory: rank 0's
    holds the one copy, rank 1's nothing (a rank that also wrote would leave a second copy)."""
    from helpers.multiproc import run_ranks

    for rank in range(2):
        (tmp_path / f"cwd-rank{rank}").mkdir()
    results = run_ranks(_save_pretrained_on_ranks, 2, tmp_path)
    out = tmp_path / "cwd-rank0" / "out"
    assert list((tmp_path / "cwd-rank1").iterdir()) == []  # rank 1 wrote nothing
    assert "model.safetensors" in [path.name for path in out.iterdir()]
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    saved, state = _weights(out), results[0]["state"]
    assert saved.keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in saved.items())
    for k, v in results[1]["state"].items():  # the same consolidated state on both ranks
        assert torch.equal(v, state[k]), k
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.values()), info  # nothing missing (filled randomly), unexpected, ...
    trained = tiny_model("llama")
    trained.load_state_dict(state)
    assert torch.equal(logits_of(loaded, IDS), logits_of(trained, IDS))
