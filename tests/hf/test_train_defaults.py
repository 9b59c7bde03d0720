"""`tierwise train`'s defaults for real checkpoints and its LoRA and wording rough edges: the
learning rate a fine-tune gets, the device budget, what a fine-tune records, the model-data
header of a LoRA run, why updates ran after backward, the summary's wrapped notes, the sample
skipped with a note."""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from tierwise.precision import optim_bytes, param_bytes
from tierwise.train import options as train_options
from tierwise.train.errors import TrainError
from tierwise.train.options import TrainOptions
from tierwise.train.prepare import demo_budget, model_data_bytes, preset_name
from tierwise.train.report import table
from tierwise.train.request import resolve
from tierwise.train.sample import SampleTooSlow, generate


def test_learning_rate_defaults_follow_what_is_trained(tmp_path):
    assert TrainOptions().lr == train_options.LR_RANDOM_INIT == 3e-3
    fine_tune = TrainOptions(from_pretrained=str(tmp_path))
    assert fine_tune.lr == train_options.LR_FULL_FINE_TUNE == 2e-5
    assert TrainOptions(from_pretrained=str(tmp_path), lora=8).lr == train_options.LR_LORA == 2e-4
    assert TrainOptions(from_pretrained=str(tmp_path), lr=1e-4).lr == 1e-4


def test_a_fine_tune_records_its_source_not_a_preset(tmp_path):
    fine_tune = TrainOptions(from_pretrained=str(tmp_path)).to_dict()
    assert fine_tune["model"] is None and fine_tune["size"] is None
    assert fine_tune["from_pretrained"] == str(tmp_path)
    assert TrainOptions().to_dict()["model"] == "gpt2"
    with pytest.raises(TrainError, match="--from-pretrained already gives the model's"):
        TrainOptions(from_pretrained=str(tmp_path), size="small")
    assert TrainOptions(from_pretrained=str(tmp_path), model="llama").model == "llama"


def test_resuming_a_fine_tune_recorded_with_a_preset_still_works(tmp_path):
    """Runs from before recorded ``"model": "gpt2", "size": "small"`` beside --from-pretrained."""
    import json

    run = tmp_path / "run"
    run.mkdir()
    saved = {**TrainOptions(from_pretrained=str(tmp_path)).to_dict(), "model": "gpt2"}
    saved["size"] = "small"
    (run / "options.json").write_text(json.dumps(saved))
    (run / "config.json").write_text(json.dumps(tierwise.Config().to_dict()))
    request = resolve({"resume": str(run)}, {})
    assert request.options.model is None and request.options.from_pretrained == str(tmp_path)


def test_the_half_budget_is_only_for_the_random_init_cpu_demo(tmp_path):
    assert demo_budget(TrainOptions(), "cpu")
    assert not demo_budget(TrainOptions(), "cuda:0")
    assert not demo_budget(TrainOptions(from_pretrained=str(tmp_path)), "cpu")


def test_preset_names_do_not_pass_the_demo_model_off_as_a_published_one():
    assert "gpt2 small" not in preset_name("gpt2", "small")
    assert "tierwise's own 'small' shape" in preset_name("gpt2", "small")
    assert preset_name("gpt2", "medium").startswith("gpt2 medium (published shape")


def test_lora_model_data_counts_the_frozen_base_without_grads_or_states():
    n_params, n_trainable = 1_000_000, 10_000
    full = model_data_bytes(n_params, "bf16")
    lora = model_data_bytes(n_params, "bf16", n_trainable=n_trainable)
    # bf16 params that take the gradients ([Note: gradients in the parameter payload]), fp32
    # master and Adam m, v
    per_trainable = param_bytes("bf16") + optim_bytes("fp32")
    assert full == n_params * per_trainable == 14 * n_params
    assert lora == n_trainable * per_trainable + (n_params - n_trainable) * param_bytes("bf16")


def test_updates_after_backward_say_why_when_every_state_is_on_the_device():
    model = tiny_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = tierwise.setup(model, optimizer, device="cpu", precision="fp32")
    engine = tierwise.engine_of(model)
    optimizer.step()  # a step with no backward before it
    assert engine.stats()["optimizer_overlap"]["reason"] == "no backward ran"
    model(**tiny_batch()).loss.backward()
    optimizer.step()
    reason = engine.stats()["optimizer_overlap"]["reason"]
    assert reason != "no backward ran" and "updated in step()" in reason


def test_long_summary_notes_wrap_within_their_column():
    note = "host-resident optimizer states on a CPU-only machine: " * 4
    text = table([("metric", "value", "note"), ("optimizer updates", "after-backward 3", note)])
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= len("optimizer updates") + 2 + 16 + 2 + 64
    assert " ".join(line[37:].strip() for line in lines[2:]) == note.strip()


def test_a_slow_sample_stops_after_its_first_token_with_the_command_to_run_it(tmp_path):
    model = tiny_model("llama").eval()
    kwargs = dict(temperature=0.0, context=16, seed=0, device=torch.device("cpu"))
    with pytest.raises(SampleTooSlow) as slow:
        generate(model, [1, 2, 3], new_tokens=200, max_seconds=0.0, **kwargs)
    note = slow.value.note(tmp_path / "run")
    assert note.startswith("sample skipped: 200 tokens would take about")
    assert f"tierwise train --resume {tmp_path / 'run'} --sample-tokens 200" in note
    assert len(generate(model, [1, 2, 3], new_tokens=5, max_seconds=None, **kwargs)) == 8
