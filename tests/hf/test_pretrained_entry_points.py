"""tierwise.from_pretrained, `tierwise train --from-pretrained` (plain and --lora) and
TierwiseTrainer with a model loaded by path: each starts from the checkpoint's weights, read
into chunks without building the model in host memory (issue 26)."""

from __future__ import annotations

import functools
from pathlib import Path

import safetensors.torch
import tierwise
import torch
import transformers
from helpers.models import tiny_model
from hf_helpers import TokenBlocks, training_args
from tierwise.cli import main
from tierwise.train.metrics import train_losses

IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))
LR = 1e-3
RUN = [
    "--model", "llama", "--batch", "2", "--seq", "32", "--sample-tokens", "0", "--steps", "1",
    "--precision", "fp32", "--device", "cpu", "--eval-batches", "1", "--lr", str(LR),
    "--warmup", "0", "--weight-decay", "0",
]  # fmt: skip


def stored(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(safetensors.torch.load_file(file))
    return out


def test_from_pretrained_builds_on_meta_and_equals_hf(tmp_path):
    tiny_model("qwen2_moe", seed=0).save_pretrained(tmp_path, max_shard_size="30KB")
    model, optimizer = tierwise.from_pretrained(
        tmp_path,
        functools.partial(torch.optim.AdamW, lr=1e-4),
        precision="fp32",
        device="cpu",
        model_kwargs={"attn_implementation": "eager"},
    )
    assert optimizer.param_groups[0]["lr"] == 1e-4 and not model.training
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    state = model.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, reference(input_ids=IDS).logits)


def _corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("def f(x):\n    return x * 2\n" * 400)
    return path


def _pretrained(tmp_path):
    """A checkpoint with the byte tokenizer's vocabulary (train's default tokenizer)."""
    from helpers.models import _config

    model = transformers.AutoModelForCausalLM.from_config(_config("llama", vocab_size=258))
    model.save_pretrained(tmp_path / "pretrained")
    return tmp_path / "pretrained"


def _first_batch(corpus_path, seq: int = 32, batch: int = 2) -> dict[str, torch.Tensor]:
    """The batch train's first step reads (byte tokenizer, seed 0, one rank)."""
    from tierwise.train import blocks, data, token_cache

    cache = token_cache.build(
        Path(corpus_path).parent / "token-cache",
        data.read_documents([str(corpus_path)]),
        data.load_tokenizer(None),
        train_on_prompt=False,
    )
    corpus = blocks.Corpus(
        cache,
        seq=seq,
        pack=True,
        pad_id=data.ByteTokenizer.pad_id,
        min_train_blocks=batch,
        max_eval_blocks=2,
    )
    sampler = blocks.BlockSampler(n_blocks=corpus.n_train, batch=batch, world=1, rank=0, seed=0)
    return corpus.train_batch(sampler.indices(0))


def test_train_from_pretrained_starts_from_the_checkpoint(tmp_path, capsys):
    folder = _pretrained(tmp_path)
    run, corpus = tmp_path / "run", _corpus(tmp_path)
    args = [*RUN, "--data", corpus, "--out", run, "--from-pretrained", folder]
    assert main([str(a) for a in ["train", *args]]) == 0, capsys.readouterr().err
    # starts from the checkpoint: step 1's loss is the checkpoint's on that batch (plain
    # transformers; a model that ignored the checkpoint would give another loss)
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = pretrained(**_first_batch(corpus)).loss.item()
    first = train_losses(run / "metrics.jsonl")[1]
    assert abs(first - expected) <= 1e-6 * expected, (first, expected)
    # and trains: AdamW's first step moves each weight by lr where its gradient is not 0
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    before, after = stored(folder), stored(tmp_path / "out")
    assert before.keys() == after.keys()
    for name, value in before.items():
        moved = (after[name] - value).abs().max()
        assert 0.99 * LR <= moved <= 1.01 * LR, (name, moved)


def test_train_lora_from_pretrained_keeps_the_base_and_trains_adapters(tmp_path, capsys):
    folder = _pretrained(tmp_path)
    run = tmp_path / "run"
    args = [*RUN, "--data", _corpus(tmp_path), "--out", run, "--from-pretrained", folder]
    assert main([str(a) for a in ["train", *args, "--lora", "4"]]) == 0, capsys.readouterr().err
    assert main(["export", str(run), str(tmp_path / "merged"), "--merge-lora"]) == 0
    before, merged = stored(folder), stored(tmp_path / "merged")
    # B starts at zero: one step changes the merged weights by a little, others not at all
    assert before.keys() == merged.keys()
    changed = [n for n in before if not torch.equal(before[n], merged[n])]
    assert changed and all("proj" in n for n in changed)
    assert all((merged[n] - before[n]).abs().max() < 1e-2 for n in changed)


def test_trainer_with_a_model_loaded_by_path(tmp_path):
    from tierwise.integrations.hf import TierwiseTrainer

    tiny_model("llama", seed=0).save_pretrained(tmp_path / "pretrained")
    trainer = TierwiseTrainer(
        model=str(tmp_path / "pretrained"),
        args=training_args(tmp_path / "run", max_steps=1, learning_rate=0.0),
        train_dataset=TokenBlocks(),
        tierwise_config={"precision": "fp32", "device": "cpu"},
    )
    before = stored(tmp_path / "pretrained")
    trainer.train()
    state = trainer.model.state_dict()
    for name, value in before.items():  # lr 0: the weights are the checkpoint's
        assert torch.equal(state[name], value), name


def test_trainer_with_model_init_sets_up_the_model_once(tmp_path):
    from tierwise.integrations.hf import TierwiseTrainer

    calls = []

    def model_init():
        calls.append(1)
        return tiny_model("llama", seed=0)

    trainer = TierwiseTrainer(
        model_init=model_init,
        args=training_args(tmp_path / "run", max_steps=2),
        train_dataset=TokenBlocks(),
        tierwise_config={"precision": "fp32", "device": "cpu"},
    )
    trainer.train()
    assert len(calls) == 1 and tierwise.engine_of(trainer.model).optimizer.steps_taken == 2
