"""TRL's SFTTrainer and Lightning Fabric through tierwise, losses side by side (issue 38).

1. ``trl.SFTTrainer`` alone and ``TierwiseSFTTrainer`` on the same Llama-style model, the same
   prompt/completion data (loss on the completion tokens only), the same seed, with a device
   budget of half the model data for tierwise (chunks offloaded to the host): fp32 (expected
   bitwise) and bf16 (TRL: autocast over fp32 weights; tierwise: bf16 weights with fp32 masters,
   so close, not equal).
2. The plain tierwise loop and the same loop through ``Fabric(strategy=TierwiseStrategy(...))``:
   fp32 and bf16 (expected bitwise: the same tierwise arithmetic).

One JSON line per comparison: both runs' losses, the largest difference, whether they are equal.

    python bench/trl_fabric.py [--steps 20]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch
from _common import emit

VOCAB = 2048
DIMS = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def llama():
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=256, **DIMS)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).train()


def tokenizer():
    import tokenizers
    import transformers

    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<eos>": VOCAB - 2, "<pad>": VOCAB - 1}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<pad>", pad_token="<pad>", eos_token="<eos>"
    )


def prompt_completion(n: int):
    import datasets

    rng = random.Random(0)

    def words(lo, hi):
        return " ".join(f"w{rng.randrange(VOCAB - 2)}" for _ in range(rng.randrange(lo, hi)))

    rows = [{"prompt": words(8, 24), "completion": words(8, 32)} for _ in range(n)]
    return datasets.Dataset.from_list(rows)


def half_budget(model) -> dict:
    n = sum(p.numel() for p in model.parameters())
    return {"device_memory": n * 20 // 2}


def compare(name: str, precision: str, ref: list[float], ours: list[float], **extra) -> None:
    diff = max(abs(a - b) for a, b in zip(ref, ours, strict=True))
    emit(
        bench=name,
        precision=precision,
        steps=len(ref),
        max_abs_loss_diff=diff,
        bitwise_equal=ref == ours,
        reference_losses=ref,
        tierwise_losses=ours,
        **extra,
    )


def sft(steps: int, precision: str) -> None:
    import trl
    from tierwise.integrations.trl import TierwiseSFTTrainer

    data, tok = prompt_completion(4 * steps), tokenizer()

    def args(out):
        return trl.SFTConfig(
            output_dir=out,
            per_device_train_batch_size=4,
            max_steps=steps,
            learning_rate=1e-3,
            logging_steps=1,
            use_cpu=True,
            bf16=precision == "bf16",
            max_length=64,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
            optim="adamw_torch_fused",
            dataloader_num_workers=0,
        )

    def losses(trainer):
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        ref = trl.SFTTrainer(llama(), args(out), train_dataset=data, processing_class=tok)
        ref.train()
        ref_s = time.perf_counter() - start
        model = llama()
        start = time.perf_counter()
        ours = TierwiseSFTTrainer(
            model,
            args(out),
            train_dataset=data,
            processing_class=tok,
            tierwise_config=half_budget(model),
        )
        ours.train()
        ours_s = time.perf_counter() - start
    import tierwise

    moved = tierwise.engine_of(ours.model).stats()["moved_bytes"].get("host->device", 0)
    compare(
        "trl_sft_vs_trl_alone",
        precision,
        losses(ref),
        losses(ours),
        completion_only_loss=True,
        gradient_checkpointing=True,
        host_to_device_bytes=moved,
        wall_s={"trl": round(ref_s, 1), "tierwise": round(ours_s, 1)},
    )


def fabric(steps: int, precision: str) -> None:
    import tierwise
    from lightning.fabric import Fabric
    from tierwise.integrations.fabric import TierwiseStrategy

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (4, 64), generator=gen) for _ in range(steps)]
    weights = llama().state_dict()

    def loop(model, opt, backward, clip):
        model.load_state_dict(weights)
        out = []
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            backward(loss)
            clip()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    with torch.device("meta"):
        model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    config = half_budget(model)
    model, opt = tierwise.setup(model, opt, config, precision=precision, device="cpu")
    ref = loop(
        model, opt, lambda loss: loss.backward(), lambda: tierwise.clip_grad_norm_(model, 1.0)
    )

    flag = {"fp32": "32-true", "bf16": "bf16-mixed"}[precision]
    fab = Fabric(
        accelerator="cpu", devices=1, strategy=TierwiseStrategy(config=config), precision=flag
    )
    with fab.init_module():
        model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, opt = fab.setup(model, opt)
    ours = loop(model, opt, fab.backward, lambda: fab.clip_gradients(model, opt, max_norm=1.0))
    compare("fabric_vs_plain_tierwise_loop", precision, ref, ours, fabric_precision=flag)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    for precision in ("fp32", "bf16"):
        sft(args.steps, precision)
    for precision in ("fp32", "bf16"):
        fabric(args.steps, precision)


if __name__ == "__main__":
    main()
