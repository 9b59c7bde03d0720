"""TierwiseTrainer against plain transformers.Trainer: losses, grad norms and weights."""

import pytest
import tierwise
import torch
from helpers.train import max_rel_diff
from hf_helpers import TokenBlocks, logged, run_plain, run_tierwise, training_args


def _assert_close(ours, ref, what):
    assert len(ours) == len(ref) > 0, what
    for a, b in zip(ours, ref, strict=True):
        assert abs(a - b) <= 1e-5 * max(abs(b), 1e-12), (what, ours, ref)


@pytest.mark.parametrize(
    "kind,accum,optim",
    [
        ("qwen2", 1, "adamw_torch_fused"),
        ("llama", 1, "adamw_torch_fused"),
        ("qwen2", 2, "adamw_torch_fused"),
        ("llama", 3, "adamw_torch_fused"),
        ("llama", 1, "adamw_torch"),
    ],
)
def test_trainer_parity_with_plain_trainer_under_offload(tmp_path, kind, accum, optim):
    data, held_out = TokenBlocks(), TokenBlocks(n=6, seed=9)
    settings = dict(
        gradient_accumulation_steps=accum, eval_strategy="steps", eval_steps=3, optim=optim
    )
    ref = run_plain(kind, training_args(tmp_path / "ref", **settings), data, eval_dataset=held_out)
    ours = run_tierwise(
        kind, training_args(tmp_path / "ours", **settings), data, eval_dataset=held_out
    )
    engine = tierwise.engine_of(ours.model)
    assert engine.stats()["moved_bytes"].get("host->device", 0) > 0  # the budget forced offload
    _assert_close(logged(ours, "loss"), logged(ref, "loss"), "loss")
    _assert_close(logged(ours, "grad_norm"), logged(ref, "grad_norm"), "grad_norm")
    _assert_close(logged(ours, "learning_rate"), logged(ref, "learning_rate"), "learning_rate")
    _assert_close(logged(ours, "eval_loss"), logged(ref, "eval_loss"), "eval_loss")
    assert len(logged(ref, "eval_loss")) == 2
    assert max(logged(ref, "grad_norm")) > 0.5  # clipping was active
    assert max_rel_diff(ours.model.state_dict(), ref.model) <= 1e-5


class _StopAt(transformers_callback := __import__("transformers").TrainerCallback):
    """Stops training after ``step`` optimizer steps (an interruption, the schedule unchanged)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def test_resume_from_checkpoint_continues_bitwise(tmp_path):
    data = TokenBlocks()
    whole = run_tierwise(
        "llama", training_args(tmp_path / "whole", gradient_accumulation_steps=2), data
    )
    args = training_args(
        tmp_path / "parts", gradient_accumulation_steps=2, save_strategy="steps", save_steps=3
    )
    first = run_tierwise("llama", args, data, callbacks=[_StopAt(3)])
    assert first.state.global_step == 3
    checkpoint = tmp_path / "parts" / "checkpoint-3"
    assert (checkpoint / "tierwise").is_dir() and (checkpoint / "model.safetensors").is_file()

    from helpers.models import tiny_model
    from hf_helpers import budget_config
    from tierwise.integrations.hf import TierwiseTrainer

    model = tiny_model("llama", seed=123)  # other initial values: the checkpoint replaces them
    second = TierwiseTrainer(
        model=model, args=args, train_dataset=data, tierwise_config=budget_config(model)
    )
    second.train(resume_from_checkpoint=str(checkpoint))
    # the log history holds the first run's 3 steps (restored) and the 3 resumed ones
    assert logged(second, "loss") == logged(whole, "loss")
    assert logged(second, "grad_norm") == logged(whole, "grad_norm")
    ours, ref = second.model.state_dict(), whole.model.state_dict()
    assert all(torch.equal(ours[name], ref[name]) for name in ref)


def test_unsupported_optim_is_one_line(tmp_path):
    from helpers.models import tiny_model
    from tierwise.integrations.hf import TierwiseTrainer, TierwiseTrainerError

    model = tiny_model("llama")
    with pytest.raises(TierwiseTrainerError) as err:
        TierwiseTrainer(
            model=model,
            args=training_args(tmp_path, optim="adafactor"),
            train_dataset=TokenBlocks(),
        )
    message = str(err.value)
    assert "\n" not in message and "adafactor" in message and "adamw_torch_fused" in message
    assert not hasattr(model, "_tierwise_engine")  # nothing was set up


def test_conflicting_precision_is_one_line(tmp_path):
    from helpers.models import tiny_model
    from tierwise.integrations.hf import TierwiseTrainer, TierwiseTrainerError

    model = tiny_model("llama")
    with pytest.raises(TierwiseTrainerError) as err:
        TierwiseTrainer(
            model=model,
            args=training_args(tmp_path, bf16=True),
            train_dataset=TokenBlocks(),
            tierwise_config={"precision": "fp32"},
        )
    message = str(err.value)
    assert "\n" not in message and "bf16" in message and "precision='fp32'" in message
    assert not hasattr(model, "_tierwise_engine")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_arguments_train_in_tierwise_precision_without_autocast(tmp_path, precision):
    from helpers.models import tiny_model
    from tierwise.integrations.hf import TierwiseTrainer

    model = tiny_model("llama")

    def moved(*args, **kwargs):
        raise AssertionError("model.to() was called on a tierwise-managed model")

    model.to = model.cuda = moved  # nothing may move it behind tierwise's back
    ours = TierwiseTrainer(
        model=model,
        train_dataset=TokenBlocks(),
        eval_dataset=TokenBlocks(n=4),
        args=training_args(
            tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, **{precision: True}
        ),
        tierwise_config={"chunk_size": 2048},
    )
    engine = tierwise.engine_of(ours.model)
    if precision == "fp16":  # a loss scale fp16 cannot hold: the first steps overflow
        engine.scaler.scale = 2.0**20
    ours.train()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert engine.config.precision == precision
    assert all(p.dtype == dtype for p in ours.model.parameters())
    assert ours.accelerator.mixed_precision == "no"  # no autocast on top of tierwise's precision
    assert all(torch.isfinite(torch.tensor(logged(ours, "eval_loss"))))
    skipped = engine.stats()["skipped_steps"]
    if precision == "fp16":  # the loss scaler's overflowing steps do not advance the schedule
        assert skipped >= 1
    assert ours.lr_scheduler.last_epoch == 4 - skipped


def test_user_optimizer_and_scheduler_are_honoured(tmp_path):
    from helpers.models import tiny_model
    from hf_helpers import budget_config
    from tierwise.integrations.hf import TierwiseTrainer

    def optimizers(model):
        groups = [
            {"params": [p for n, p in model.named_parameters() if "norm" not in n]},
            {"params": [p for n, p in model.named_parameters() if "norm" in n], "lr": 3e-3},
        ]
        opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, fused=True)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))

    import transformers

    data = TokenBlocks()
    ref_model = tiny_model("llama")
    ref = transformers.Trainer(
        model=ref_model,
        args=training_args(tmp_path / "ref"),
        train_dataset=data,
        optimizers=optimizers(ref_model),
    )
    ref.train()
    model = tiny_model("llama")
    ours = TierwiseTrainer(
        model=model,
        args=training_args(tmp_path / "ours"),
        train_dataset=data,
        optimizers=optimizers(model),
        tierwise_config=budget_config(model),
    )
    ours.train()
    _assert_close(logged(ours, "loss"), logged(ref, "loss"), "loss")
    _assert_close(logged(ours, "learning_rate"), logged(ref, "learning_rate"), "learning_rate")
    assert max_rel_diff(ours.model.state_dict(), ref.model) <= 1e-5


def test_tierwise_config_file_gives_precision_only_when_it_names_it(tmp_path):
    from tierwise.integrations.hf import TierwiseTrainerError, config_dict, precision_of

    args = training_args(tmp_path)  # neither bf16 nor fp16: fp32
    quiet = tmp_path / "budget.toml"
    quiet.write_text('[tierwise]\ndevice_memory = "1MiB"\n')
    assert precision_of(args, config_dict(quiet)) == "fp32"  # Config's bf16 default is not given
    loud = tmp_path / "bf16.json"
    loud.write_text('{"precision": "bf16"}')
    with pytest.raises(TierwiseTrainerError, match="TrainingArguments ask for fp32"):
        precision_of(args, config_dict(loud))
    assert precision_of(training_args(tmp_path, bf16=True), config_dict(loud)) == "bf16"
