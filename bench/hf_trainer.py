"""TierwiseTrainer against tierwise's own loop, and LoRA against full fine-tuning (issue 18).

1. Tokens/s of ``TierwiseTrainer`` (transformers.Trainer, clipping, linear schedule) and of a
   plain loop over ``tierwise.setup`` doing the same work (clip, step, zero_grad, scheduler) on
   the same Llama-style model, data shape, config and device budget (half the model data, so
   chunks are offloaded to the host). The two run step by step in turn (the loop's step between
   two Trainer steps, off the Trainer's clock), so both see the same load on a shared machine;
   the ratio is of median step times after each run's first (warm-up) step, in wall seconds, in
   process CPU seconds, and as the median of per-pair ratios. Target: at most 1.03.
2. Model data per tier (peak bytes) of a full fine-tune and of LoRA (PEFT, rank 8 on q/v) at the
   same budget, after two steps.

    python bench/hf_trainer.py [--steps 8] [--rounds 3] [--small] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import tierwise
import torch
from _common import emit

VOCAB = 4096


def llama(dims: dict):
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=1024, **dims)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).train()


class Blocks(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int):
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def config_for(model) -> dict:
    n = sum(p.numel() for p in model.parameters())
    return {"precision": "fp32", "device": "cpu", "device_memory": n * 20 // 2}


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> tuple[float, float]:
    """(wall, process CPU) seconds since ``start``."""
    return time.perf_counter() - start[0], time.process_time() - start[1]


def loop_stepper(dims, data, steps, batch):
    """tierwise's own loop, one step per call; each call returns that step's times."""
    import transformers as tf

    model = llama(dims)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    model, opt = tierwise.setup(model, opt, config_for(model))
    scheduler = tf.get_scheduler("linear", opt, num_warmup_steps=1, num_training_steps=steps)
    batches = iter(torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True))

    def step() -> tuple[float, float]:
        inputs = next(batches)
        start = clock()
        model(**inputs).loss.backward()
        tierwise.clip_grad_norm_(model, 1.0)
        opt.step()
        scheduler.step()
        model.zero_grad()
        return since(start)

    return step


def interleaved_step_times(dims, data, steps, batch):
    """A TierwiseTrainer run and the loop, one step each in turn (the loop's step runs between
    two Trainer steps, outside the Trainer's clock), so both see the same machine load.
    Returns (trainer, loop) lists of (wall, CPU) seconds per step."""
    import transformers as tf
    from tierwise.integrations.hf import TierwiseTrainer

    trainer_times: list[tuple[float, float]] = []
    loop_times: list[tuple[float, float]] = []
    loop_step = loop_stepper(dims, data, steps, batch)

    class StepClock(tf.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = clock()

        def on_step_end(self, args, state, control, **kwargs):
            trainer_times.append(since(self.start))
            loop_times.append(loop_step())

    model = llama(dims)
    with tempfile.TemporaryDirectory() as out:
        args = tf.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=batch,
            max_steps=steps,
            learning_rate=1e-4,
            weight_decay=0.01,
            lr_scheduler_type="linear",
            warmup_steps=1,
            max_grad_norm=1.0,
            optim="adamw_torch_fused",
            logging_steps=10**6,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = TierwiseTrainer(
            model=model,
            args=args,
            train_dataset=data,
            tierwise_config=config_for(model),
            callbacks=[StepClock()],
        )
        trainer.train()
    return trainer_times, loop_times


def lora_memory(dims, data, batch) -> dict:
    import peft

    out = {}
    for kind in ("full", "lora"):
        model = llama(dims)
        config = config_for(model)
        if kind == "lora":
            model = peft.get_peft_model(
                model,
                peft.LoraConfig(
                    r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
                ),
            )
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        model, opt = tierwise.setup(model, opt, config)
        for step in range(2):
            inputs = data[[step * batch + i for i in range(batch)]]
            model(**inputs).loss.backward()
            opt.step()
            model.zero_grad()
        stats = tierwise.engine_of(model).stats()
        out[kind] = {
            "trainable_params": trainable,
            "peak_bytes_by_tier": stats["peak_bytes_by_tier"],
            "bytes_by_tier": stats["bytes_by_tier"],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a smaller model (quick check)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (1 on a shared machine: no spinning on descheduled peers)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dims = dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    if args.small:
        dims = dict(
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    batch, seq = 4, 128
    data = Blocks(batch * args.steps * 2, seq)
    params = sum(p.numel() for p in llama(dims).parameters())
    trainer_times, loop_times = [], []
    for _ in range(args.rounds):
        ours, loop = interleaved_step_times(dims, data, args.steps, batch)
        trainer_times += ours[1:]
        loop_times += loop[1:]
    ratios = sorted(a[0] / b[0] for a, b in zip(trainer_times, loop_times, strict=True))
    trainer_s, loop_s = (statistics.median(t[0] for t in ts) for ts in (trainer_times, loop_times))
    trainer_cpu, loop_cpu = (
        statistics.median(t[1] for t in ts) for ts in (trainer_times, loop_times)
    )
    emit(
        bench="hf_trainer",
        what="TierwiseTrainer vs tierwise loop",
        params=params,
        batch=batch,
        seq=seq,
        steps=args.steps,
        rounds=args.rounds,
        trainer_tokens_per_s=batch * seq / trainer_s,
        loop_tokens_per_s=batch * seq / loop_s,
        trainer_over_loop_step_time=trainer_s / loop_s,
        target="<= 1.03",
        trainer_over_loop_step_cpu_time=trainer_cpu / loop_cpu,
        trainer_over_loop_paired_median=statistics.median(ratios),
        threads=torch.get_num_threads(),
        note="steps interleaved (Trainer step, loop step, ...); medians over rounds of the steps "
        "after each run's first; paired = median of per-step-pair wall ratios; CPU time = "
        "process CPU seconds per step",
    )
    emit(
        bench="hf_trainer",
        what="LoRA vs full fine-tune model data per tier",
        params=params,
        budget_device_bytes=params * 20 // 2,
        **lora_memory(dims, data, batch),
    )


if __name__ == "__main__":
    main()
