"""PEFT LoRA through tierwise.setup and TierwiseTrainer, against plain PEFT (+ Trainer)."""

import pytest
import tierwise
import torch
from helpers.models import tiny_lora_model, tiny_model
from helpers.train import max_rel_diff
from hf_helpers import TokenBlocks, logged, logits_of, training_args

peft = pytest.importorskip("peft", reason="the PEFT tests need peft (tierwise[peft])")
IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))


def lora_model(kind="llama"):
    return tiny_lora_model(kind)


def _base_weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}


def test_lora_through_setup_matches_plain_peft_and_keeps_the_base():
    ref = lora_model()
    ref_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, fused=True
    )
    model = lora_model()
    base_before = _base_weights(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        chunk_size=2048,
        param_placement="host",
        cache_blocks=4,
    )
    engine = tierwise.engine_of(model)
    frozen = [c for c in engine.chunks() if not c.trainable]
    assert frozen and all(c.optim is None for c in frozen)  # no Adam states, no gradient shard
    assert all(c.home.tier.name == "host" for c in frozen)
    for step in range(4):
        batch = {"input_ids": IDS, "labels": IDS}
        losses = []
        for m, o in ((ref, ref_opt), (model, opt)):
            loss = m(**batch).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-6 * abs(losses[0]), step
    state = model.state_dict()
    assert max_rel_diff(state, dict(ref.named_parameters())) <= 1e-5
    assert all(torch.equal(state[k], v) for k, v in base_before.items())


def test_lora_trainer_matches_plain_trainer_and_saves_adapters(tmp_path, monkeypatch):
    import transformers
    from tierwise.integrations import hf
    from tierwise.integrations.hf import TierwiseTrainer

    data = TokenBlocks()
    ref = transformers.Trainer(
        model=lora_model(), args=training_args(tmp_path / "ref"), train_dataset=data
    )
    ref.train()
    model = lora_model()
    base_before = _base_weights(model)
    ours = TierwiseTrainer(
        model=model,
        args=training_args(tmp_path / "ours"),
        train_dataset=data,
        tierwise_config={"chunk_size": 2048, "param_placement": "host", "cache_blocks": 4},
    )
    ours.train()
    for key in ("loss", "grad_norm"):
        for a, b in zip(logged(ours, key), logged(ref, key), strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), key
    state = ours.model.state_dict()
    assert max_rel_diff(state, dict(ref.model.named_parameters())) <= 1e-5
    assert all(torch.equal(state[k], v) for k, v in base_before.items())

    gathered = []  # what save_model gathers from the chunks: the adapters, never the base
    real_full_state = hf.full_state
    monkeypatch.setattr(
        hf, "full_state", lambda *a, **k: gathered.append(real_full_state(*a, **k)) or gathered[-1]
    )
    ours.save_model(str(tmp_path / "adapter"))
    assert gathered and all(".lora_" in name for name in gathered[0])
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    base = tiny_model("llama")  # the same initial base the run started from
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert torch.equal(logits_of(loaded, IDS), logits_of(ours.model, IDS))


def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path):
    import safetensors.torch
    from tierwise.integrations.hf import TierwiseTrainer

    args = training_args(
        tmp_path,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        learning_rate=5e-2,
        greater_is_better=True,
    )  # the worst loss: an earlier checkpoint
    trainer = TierwiseTrainer(
        model=lora_model(),
        args=args,
        train_dataset=TokenBlocks(),
        eval_dataset=TokenBlocks(n=4, seed=9),
        tierwise_config={"chunk_size": 2048},
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and not best.endswith("checkpoint-6")  # not the final weights
    adapters = safetensors.torch.load_file(f"{best}/adapter_model.safetensors")
    state = trainer.model.state_dict()
    assert adapters
    for name, value in adapters.items():  # PEFT drops the adapter name when it saves
        assert torch.equal(state[name.replace(".weight", ".default.weight")], value), name
