"""The loss of `tierwise train`'s instruction rows equals TRL's SFTTrainer's on the same
conversations (in the frameworks env, where trl is installed at its pinned version)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("trl")

from helpers.chat import CONVERSATION, chat_tokenizer_dir  # noqa: E402
from helpers.models import _config  # noqa: E402
from tierwise.train import blocks, data, token_cache  # noqa: E402
from tierwise.train.tokenizers import HFTokenizer  # noqa: E402


def _cache(tmp_path, records, tokenizer) -> token_cache.TokenCache:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cache, _ = token_cache.open_or_build(
        [str(path)],
        tokenizer,
        train_on_prompt=False,
        root=tmp_path / "cache",
        documents=data.read_documents([str(path)]),
    )
    return cache


GENERATION_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML with TRL's ``{% generation %}`` markers (what ``assistant_only_loss`` needs) around
the same text the assistant-turn spans cover."""


def test_chat_loss_equals_trl_sft_on_the_same_conversations(tmp_path):
    """TRL's SFTTrainer (assistant_only_loss) and tierwise train's rows give the same loss for the
    same four conversations through the same model."""
    import datasets
    import transformers as tf
    from trl import SFTConfig, SFTTrainer

    folder = chat_tokenizer_dir(tmp_path / "tok")
    hf_tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    hf_tokenizer.chat_template = GENERATION_CHATML
    hf_tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config("llama", vocab_size=258)).eval()
    conversations = [
        [{**m, "content": f"{m['content']} {i}"} for m in CONVERSATION[: 3 + 2 * (i % 2)]]
        for i in range(8)
    ]
    args = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        max_length=256,
        report_to=[],
        packing=False,
        assistant_only_loss=True,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list([{"messages": c} for c in conversations]),
        processing_class=hf_tokenizer,
    )
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    cache = _cache(tmp_path, [{"messages": c} for c in conversations], HFTokenizer(str(folder)))
    corpus = blocks.Corpus(
        cache, seq=256, pack=False, pad_id=257, min_train_blocks=4, eval_fraction=0.01
    )
    ours = corpus.train_batch(np.arange(4))
    assert ours["input_ids"][:, : trl_batch["input_ids"].shape[1]].tolist() == [
        [t if keep else 257 for t, keep in zip(row, mask, strict=True)]
        for row, mask in zip(
            trl_batch["input_ids"].tolist(), trl_batch["attention_mask"].tolist(), strict=True
        )
    ]
    with torch.no_grad():
        trl_loss = trainer.compute_loss(model, trl_batch)
        loss = model(**ours).loss
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-6)
