"""`tierwise train` on chat data, end to end: a fine-tune of a checkpoint whose first loss is
plain transformers' on the same conversations with the assistant turns masked by hand (the loss
TRL's SFT computes), the token cache reused by the next run, and chat data with the byte
tokenizer refused in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.chat import CONVERSATION, chat_tokenizer_dir, hand_labels  # noqa: E402
from helpers.cli import run_cli  # noqa: E402
from helpers.models import _config  # noqa: E402
from tierwise.train.blocks import BlockSampler  # noqa: E402
from tierwise.train.metrics import train_losses  # noqa: E402

SEQ, BATCH = 256, 2


def _conversations(n: int) -> list[list[dict]]:
    """Two or four turns each, the answers varied."""
    out = []
    for i in range(n):
        turns = CONVERSATION[: 3 + 2 * (i % 2)]
        out.append([{**m, "content": f"{m['content']} {i}"} for m in turns])
    return out


def _train_rows(conversations) -> int:
    """How many training rows --no-pack makes: the conversations that end before the held-out
    last 5% of the tokens (at least --seq of them), and the part of the one that straddles it
    when that part has a target after its first token."""
    rows = [hand_labels(c) for c in conversations]
    n_tokens = sum(len(ids) for ids, _ in rows)
    boundary = n_tokens - max(SEQ, int(n_tokens * 0.05))
    whole, start = 0, 0
    for ids, labels in rows:
        if start + len(ids) <= boundary:
            whole += 1
        elif start < boundary:
            part = labels[1 : boundary - start]
            whole += any(label != -100 for label in part)
        start += len(ids)
    return whole


def _reference_loss(model, rows) -> float:
    """Mean cross-entropy over every target token of the batch, each conversation alone."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels in rows:
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            target = torch.tensor(labels[1:])
            keep = target != -100
            total += torch.nn.functional.cross_entropy(
                logits[keep], target[keep], reduction="sum"
            ).item()
            count += int(keep.sum())
    return total / count


def test_chat_fine_tune_starts_at_the_hand_masked_loss_and_reuses_its_tokens(tmp_path):
    base = tmp_path / "base"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_config("llama", vocab_size=258)).save_pretrained(
        base
    )
    chat_tokenizer_dir(base)  # the checkpoint carries its chat tokenizer
    conversations = _conversations(40)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    common = [
        *("train", "--from-pretrained", base, "--data", data, "--no-pack", "--steps", "1"),
        *("--batch", BATCH, "--seq", SEQ, "--precision", "fp32", "--device", "cpu"),
        *("--eval-batches", "1", "--sample-tokens", "3", "--warmup", "0"),
    ]
    result = run_cli(*map(str, [*common, "--out", tmp_path / "run"]))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "one document per row (--no-pack)" in out and "tokenised into" in out
    assert "outputs in" in out and "hf/" in out.split("outputs in")[1]
    options = json.loads((tmp_path / "run" / "options.json").read_text())
    assert options["model"] is None and options["from_pretrained"] == str(base)
    assert options["lr"] == 2e-5 and options["train_on_prompt"] is False
    # step 1's loss: the rows the sampler drew (one conversation each), masked by hand
    sampler = BlockSampler(
        n_blocks=_train_rows(conversations), batch=BATCH, world=1, rank=0, seed=0
    )
    rows = sampler.indices(0).tolist()
    reference = _reference_loss(
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        [hand_labels(conversations[r]) for r in rows],
    )
    first = train_losses(tmp_path / "run" / "metrics.jsonl")[1]
    assert math.isclose(first, reference, rel_tol=1e-5), (first, reference)
    # the next run on the same data and tokenizer reads the cached tokens
    again = run_cli(*map(str, [*common, "--out", tmp_path / "again", "--sample-tokens", "0"]))
    assert again.returncode == 0, again.stderr
    assert "(reused)" in again.stdout
    # the command a skipped sample names: a finished run resumed only to sample
    sample = run_cli("train", "--resume", str(tmp_path / "again"), "--sample-tokens", "2")
    assert sample.returncode == 0, sample.stderr
    assert "== sample ==" in sample.stdout and "nothing to do" not in sample.stdout


def test_chat_data_with_the_byte_tokenizer_is_one_line(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    result = run_cli("train", "--data", str(data), "--steps", "1", "--out", str(tmp_path / "r"))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("tierwise")]
    assert len(errors) == 1 and "chat.jsonl:1" in errors[0] and "byte tokenizer" in errors[0]
    assert not (tmp_path / "r").exists()
