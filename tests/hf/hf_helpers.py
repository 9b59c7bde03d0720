"""Datasets, TrainingArguments and runners shared by the Hugging Face integration tests."""

from __future__ import annotations

import torch
from helpers.models import VOCAB, tiny_model

SEQ = 16


class TokenBlocks(torch.utils.data.Dataset):
    """``n`` random blocks of token ids with labels = inputs (causal LM loss)."""

    def __init__(self, n: int = 32, seq: int = SEQ, seed: int = 5):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def training_args(out, **overrides):
    """fp32 on the CPU, AdamW fused, weight decay, clipping, linear schedule with warmup."""
    import transformers

    values = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        max_steps=6,
        learning_rate=1e-2,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        warmup_steps=2,
        max_grad_norm=0.5,
        optim="adamw_torch_fused",
        logging_steps=1,
        seed=0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def budget_config(model: torch.nn.Module, **extra) -> dict:
    """A tierwise_config whose device budget holds half the fp32 model data (parameters,
    gradients, master weights and Adam states), so chunks live on the host and move in and out
    (offload)."""
    n = sum(p.numel() for p in model.parameters())
    return {"device_memory": n * 20 // 2, "chunk_size": 2048, **extra}


def logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def run_plain(kind: str, args, dataset, **trainer_kwargs):
    import transformers

    model = tiny_model(kind)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, **trainer_kwargs)
    trainer.train()
    return trainer


def run_tierwise(kind: str, args, dataset, config=None, **trainer_kwargs):
    from tierwise.integrations.hf import TierwiseTrainer

    model = tiny_model(kind)
    config = budget_config(model) if config is None else config
    trainer = TierwiseTrainer(
        model=model, args=args, train_dataset=dataset, tierwise_config=config, **trainer_kwargs
    )
    trainer.train()
    return trainer


def tiny_tokenizer():
    """A word-level fast tokenizer over VOCAB tokens, built offline."""
    import tokenizers
    import transformers

    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    model = tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<unk>"
    )


@torch.no_grad()
def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    was_training = model.training
    model.eval()
    try:
        return model(input_ids=ids).logits.float()
    finally:
        model.train(was_training)
