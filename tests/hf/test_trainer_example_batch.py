"""TierwiseTrainer gives ``tierwise.setup`` the first batch of its train dataloader ([Note: the
Trainer's example batch]): the batch is the one training starts with, drawing it changes nothing
training draws (data order, dropout, a meta model's initial values: bitwise against the same
trainer without an example batch and against ``tierwise.setup`` itself), and with the search
plugin the plan predicts a step."""

import pytest
import tierwise
import torch
import transformers
from helpers.models import _config
from hf_helpers import TokenBlocks, budget_config, logged, training_args
from tierwise.integrations import hf as tierwise_hf
from tierwise.integrations.hf import TierwiseTrainer


class Recording(TierwiseTrainer):
    """Records the input ids of every batch it trains on."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.seen.append(inputs["input_ids"].clone())
        return super().compute_loss(model, inputs, *args, **kwargs)


def meta_llama() -> torch.nn.Module:
    """A tiny llama with attention dropout (training draws random numbers), on the meta device
    (setup draws its initial values)."""
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(
            _config("llama", attention_dropout=0.25)
        ).train()


def run(tmp_path, name, monkeypatch, *, with_example_batch: bool):
    given = []
    setup = tierwise.api.setup

    def spy(*args, example_batch=None, **kwargs):
        given.append(example_batch)
        return setup(*args, example_batch=example_batch, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(tierwise.api, "setup", spy)
        if not with_example_batch:  # the trainer as it was: setup without a batch
            patch.setattr(tierwise_hf, "first_train_batch", lambda trainer: None)
        torch.manual_seed(3)  # the caller's state: the meta model's values come from it
        model = meta_llama()
        trainer = Recording(
            model=model,
            args=training_args(tmp_path / name, max_steps=4),
            train_dataset=TokenBlocks(),
            tierwise_config=budget_config(model),
        )
    trainer.seen = []
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    return trainer, given[0], initial


def test_setup_gets_the_first_batch_and_training_draws_what_it_drew_without_it(
    tmp_path, monkeypatch
):
    ours, example, initial = run(tmp_path, "ours", monkeypatch, with_example_batch=True)
    without, none, initial_without = run(tmp_path, "without", monkeypatch, with_example_batch=False)
    assert none is None
    # the example is the first batch trained on, collated (labels included)
    assert torch.equal(example["input_ids"], ours.seen[0])
    assert torch.equal(example["labels"], ours.seen[0])
    # shuffled data: the same order, the same dropout, the same initial values, bitwise
    assert len(ours.seen) == len(without.seen) == 4
    assert all(torch.equal(a, b) for a, b in zip(ours.seen, without.seen, strict=True))
    assert ours.seen[0].tolist() != TokenBlocks().ids[:2].tolist()  # the sampler shuffled
    for name, value in initial_without.items():
        assert torch.equal(initial[name], value), name
    for key in ("loss", "grad_norm"):
        assert logged(ours, key) == logged(without, key), key
    final, final_without = ours.model.state_dict(), without.model.state_dict()
    for name, value in final_without.items():
        assert torch.equal(final[name], value), name


def test_a_meta_model_gets_the_values_setup_gives_it_from_the_callers_random_state(tmp_path):
    """The reference is ``tierwise.setup`` called directly after the same seed."""
    torch.manual_seed(3)
    model = meta_llama()
    config = {**budget_config(model), "precision": "fp32", "device": "cpu"}
    tierwise.setup(model, torch.optim.AdamW(model.parameters()), config)
    reference = model.state_dict()
    torch.manual_seed(3)
    model = meta_llama()
    trainer = TierwiseTrainer(
        model=model,
        args=training_args(tmp_path, seed=11),  # Trainer's set_seed differs from the caller's
        train_dataset=TokenBlocks(),
        optimizers=(torch.optim.AdamW(model.parameters()), None),
        tierwise_config=budget_config(model),
    )
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, reference[name]), name


@pytest.mark.combined  # the step prediction is the search plugin's
def test_the_trainers_plan_predicts_a_step(tmp_path):
    from tierwise.plugins import get_plugin_host

    if "search" not in {info.name for info in get_plugin_host().infos()}:
        pytest.skip("the step prediction is the search plugin's, which is not loaded")
    model = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    trainer = TierwiseTrainer(
        model=model,
        args=training_args(tmp_path),
        train_dataset=TokenBlocks(),
        tierwise_config=budget_config(model),
    )
    plan = tierwise.engine_of(trainer.model).plan
    assert plan.predicted_step_s["forward"] > 0
    assert plan.predicted_step_s["total"] > plan.predicted_step_s["forward"]
    assert plan.predicted_tokens_per_s > 0
    assert "predicted forward" in plan.table() and "example_batch" not in plan.table()


def test_a_tokenizers_collator_gives_setup_a_plain_dict(tmp_path, monkeypatch):
    """Trainer collates with the tokenizer's padding collator, which returns a BatchEncoding (a
    Mapping, no dict): setup gets its contents as a dict, which profilers call ``model(**batch)``
    with."""
    from hf_helpers import tiny_tokenizer

    given = []
    setup = tierwise.api.setup

    def spy(*args, example_batch=None, **kwargs):
        given.append(example_batch)
        return setup(*args, example_batch=example_batch, **kwargs)

    monkeypatch.setattr(tierwise.api, "setup", spy)
    rows = [{"input_ids": ids.tolist(), "labels": ids.tolist()} for ids in TokenBlocks(n=4).ids]
    model = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    TierwiseTrainer(
        model=model,
        args=training_args(tmp_path),
        train_dataset=rows,
        processing_class=tiny_tokenizer(),
        tierwise_config=budget_config(model),
    )
    (example,) = given
    assert type(example) is dict
    assert example["input_ids"].shape == (2, TokenBlocks().ids.shape[1])
