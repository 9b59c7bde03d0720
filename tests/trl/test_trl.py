"""TRL's SFTTrainer and DPOTrainer through tierwise against TRL alone: the same model, data and
seed, losses side by side ([Note: TRL's trainers through tierwise]). fp32 on the CPU with a
device budget of half the model data, so chunks move in and out of the rCache while TRL's fused
LM head projects through ``lm_head.weight`` outside ``lm_head``'s forward."""

import random

import datasets
import peft
import pytest
import tierwise
import torch
import trl
from helpers.models import tiny_model
from hf.hf_helpers import budget_config, tiny_tokenizer
from tierwise.integrations.hf import TierwiseTrainer, TierwiseTrainerError
from tierwise.integrations.trl import TierwiseDPOTrainer, TierwiseSFTTrainer


def words(rng, lo=3, hi=8):
    return " ".join(f"t{rng.randrange(120)}" for _ in range(rng.randrange(lo, hi)))


def prompt_completion(n=16, seed=0):
    rng = random.Random(seed)
    return datasets.Dataset.from_list(
        [{"prompt": words(rng), "completion": words(rng)} for _ in range(n)]
    )


def preferences(n=12, seed=1):
    rng = random.Random(seed)
    return datasets.Dataset.from_list(
        [{"prompt": words(rng), "chosen": words(rng), "rejected": words(rng)} for _ in range(n)]
    )


def tokenizer():
    tok = tiny_tokenizer()
    tok.eos_token = "t126"  # TRL appends EOS to completions
    return tok


COMMON = dict(
    per_device_train_batch_size=2,
    max_steps=4,
    learning_rate=1e-2,
    logging_steps=1,
    use_cpu=True,
    bf16=False,
    report_to=[],
    save_strategy="no",
    disable_tqdm=True,
    seed=0,
    max_grad_norm=0.5,
    optim="adamw_torch_fused",
    dataloader_num_workers=0,
)


def sft_args(out, **kw):
    return trl.SFTConfig(output_dir=str(out), max_length=32, **{**COMMON, **kw})


def dpo_args(out, **kw):
    return trl.DPOConfig(output_dir=str(out), max_length=32, **{**COMMON, **kw})


def lora():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def assert_same_run(ours, ref, keys=("loss", "grad_norm")):
    for key in keys:
        assert len(logged(ref, key)) == 4, key
        assert logged(ours, key) == logged(ref, key), key
    ours_state, ref_state = ours.model.state_dict(), ref.model.state_dict()
    assert ours_state.keys() == ref_state.keys()
    for name, value in ref_state.items():
        assert torch.equal(ours_state[name], value), name


def test_sft_matches_trl_bitwise(tmp_path):
    data, tok = prompt_completion(), tokenizer()
    ref = trl.SFTTrainer(
        tiny_model("llama"), sft_args(tmp_path / "r"), train_dataset=data, processing_class=tok
    )
    ref.train()
    model = tiny_model("llama")
    ours = TierwiseSFTTrainer(
        model,
        sft_args(tmp_path / "o"),
        train_dataset=data,
        processing_class=tok,
        tierwise_config=budget_config(model),
    )
    ours.train()
    assert tierwise.engine_of(ours.model).stats()["moved_bytes"].get("host->device", 0) > 0
    assert_same_run(ours, ref, keys=("loss", "grad_norm", "mean_token_accuracy"))


def test_sft_gradient_checkpointing_is_tierwise_recompute(tmp_path):
    data, tok = prompt_completion(), tokenizer()
    ref_args = sft_args(tmp_path / "r", gradient_checkpointing=True)
    ref = trl.SFTTrainer(tiny_model("llama"), ref_args, train_dataset=data, processing_class=tok)
    ref.train()
    model = tiny_model("llama")
    args = sft_args(tmp_path / "o", gradient_checkpointing=True)
    ours = TierwiseSFTTrainer(
        model, args, train_dataset=data, processing_class=tok, tierwise_config=budget_config(model)
    )
    ours.train()
    engine = tierwise.engine_of(ours.model)
    assert engine.plan.activation_checkpointing
    assert engine.stats()["activations"]["recomputed_blocks"] > 0
    # Trainer does not switch on Hugging Face's checkpointing as well (tierwise sets the blocks)
    assert not args.activation_checkpointing and not args.gradient_checkpointing
    assert_same_run(ours, ref)


def test_sft_lora_matches_trl_bitwise(tmp_path):
    data, tok = prompt_completion(), tokenizer()
    ref = trl.SFTTrainer(
        tiny_model("llama"),
        sft_args(tmp_path / "r"),
        train_dataset=data,
        processing_class=tok,
        peft_config=lora(),
    )
    ref.train()
    model = tiny_model("llama")
    ours = TierwiseSFTTrainer(
        model,
        sft_args(tmp_path / "o"),
        train_dataset=data,
        processing_class=tok,
        peft_config=lora(),
        tierwise_config=budget_config(model),
    )
    ours.train()
    assert_same_run(ours, ref)


@pytest.mark.parametrize("reference", ["peft", "precomputed"])
def test_dpo_matches_trl_bitwise(tmp_path, reference):
    datasets.disable_caching()  # each run computes its own reference log-probs
    data, tok = preferences(), tokenizer()
    kw = dict(peft_config=lora()) if reference == "peft" else {}
    extra = dict(precompute_ref_log_probs=True) if reference == "precomputed" else {}
    ref = trl.DPOTrainer(
        tiny_model("llama"),
        args=dpo_args(tmp_path / "r", **extra),
        train_dataset=data,
        processing_class=tok,
        **kw,
    )
    assert ref.ref_model is None  # TRL alone uses no second model either
    ref.train()
    model = tiny_model("llama")
    ours = TierwiseDPOTrainer(
        model,
        args=dpo_args(tmp_path / "o", **extra),
        train_dataset=data,
        processing_class=tok,
        tierwise_config=budget_config(model),
        **kw,
    )
    assert ours.ref_model is None
    ours.train()
    assert_same_run(ours, ref, keys=("loss", "grad_norm", "rewards/margins"))


def test_dpo_refuses_a_second_model(tmp_path):
    with pytest.raises(TierwiseTrainerError, match="ref_model is a second full copy"):
        TierwiseDPOTrainer(tiny_model("llama"), tiny_model("llama"), args=dpo_args(tmp_path))
    with pytest.raises(
        TierwiseTrainerError, match="pass peft_config .* or set precompute_ref_log_probs"
    ):
        TierwiseDPOTrainer(tiny_model("llama"), args=dpo_args(tmp_path))


def test_path_model_and_the_other_class_order_are_refused(tmp_path):
    with pytest.raises(TierwiseTrainerError, match="`model` must be a torch module"):
        TierwiseSFTTrainer("some/checkpoint", sft_args(tmp_path))

    class TierwiseFirst(TierwiseTrainer, trl.SFTTrainer):
        pass

    with pytest.raises(
        TierwiseTrainerError, match="use tierwise.integrations.trl.TierwiseSFTTrainer"
    ):
        TierwiseFirst(model=tiny_model("llama"), args=sft_args(tmp_path))


class _Recording:
    """Records the model inputs of every batch the trainer trains on, and what setup got."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.seen.append({k: v.clone() for k, v in inputs.items() if torch.is_tensor(v)})
        return super().compute_loss(model, inputs, *args, **kwargs)


def _spy_setup(monkeypatch) -> list:
    given = []
    setup = tierwise.api.setup

    def spy(*args, example_batch=None, **kwargs):
        given.append(example_batch)
        return setup(*args, example_batch=example_batch, **kwargs)

    monkeypatch.setattr(tierwise.api, "setup", spy)
    return given


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_setup_gets_the_first_batch_as_the_model_is_called_with_it(tmp_path, monkeypatch, trainer):
    """[Note: the Trainer's example batch]: the first batch TRL trains on, as its loss calls the
    model (DPO: chosen and rejected rows, completion labels, no loss-only keys); the runs above
    stay bitwise with TRL alone."""
    given = _spy_setup(monkeypatch)
    tok, model = tokenizer(), tiny_model("llama")
    if trainer == "sft":
        cls = type("T", (_Recording, TierwiseSFTTrainer), {})
        args, data, kw = sft_args(tmp_path, max_steps=1), prompt_completion(), {}
    else:
        cls = type("T", (_Recording, TierwiseDPOTrainer), {})
        args, data, kw = dpo_args(tmp_path, max_steps=1), preferences(), dict(peft_config=lora())
    ours = cls(model, args=args, train_dataset=data, processing_class=tok, **kw)
    ours.seen = []
    ours.train()
    (example,), first = given, ours.seen[0]
    assert torch.equal(example["input_ids"], first["input_ids"])
    assert torch.equal(example["attention_mask"], first["attention_mask"])
    if trainer == "sft":
        assert example.keys() == first.keys()
        assert torch.equal(example["labels"], first["labels"])
    else:
        assert example.keys() == {"input_ids", "attention_mask", "labels"}
        labels = first["input_ids"].masked_fill(first["completion_mask"] == 0, -100)
        assert torch.equal(example["labels"], labels)
        assert example["input_ids"].shape[0] == 2 * COMMON["per_device_train_batch_size"]


def test_sft_plan_predicts_a_step(tmp_path):
    """The step prediction is the search plugin's (not in the `frameworks` env: see the test
    above for what setup gets there)."""
    from tierwise.plugins import get_plugin_host

    if "search" not in {info.name for info in get_plugin_host().infos()}:
        pytest.skip("the step prediction is the search plugin's, which is not loaded")
    model = tiny_model("llama")
    ours = TierwiseSFTTrainer(
        model,
        sft_args(tmp_path),
        train_dataset=prompt_completion(),
        processing_class=tokenizer(),
        tierwise_config=budget_config(model),
    )
    plan = tierwise.engine_of(ours.model).plan
    assert plan.predicted_step_s["forward"] > 0
    assert plan.predicted_step_s["total"] > plan.predicted_step_s["forward"]
    assert "predicted forward" in plan.table()
