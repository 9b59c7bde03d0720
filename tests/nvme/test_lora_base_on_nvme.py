"""LoRA (PEFT) with the frozen base on the NVMe tier: no optimizer states or gradient memory for
it, the adapters train as plain PEFT trains them, and the base stays bitwise unchanged."""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model

peft = pytest.importorskip("peft", reason="the LoRA test needs peft (tierwise[peft])")


def _lora_model():
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        init_lora_weights="gaussian",
    )
    return peft.get_peft_model(tiny_model("llama"), config)


def test_frozen_base_on_nvme_trains_only_the_adapters(nvme_dir):
    ref = _lora_model()
    ref_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, fused=True
    )
    model = _lora_model()
    base = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        chunk_size=2048,
        param_placement="nvme",
        nvme_path=str(nvme_dir),
        cache_blocks=4,
    )
    engine = tierwise.engine_of(model)
    frozen = [c for c in engine.chunks() if not c.trainable]
    assert frozen and all(c.optim is None and c.home.tier.name == "nvme" for c in frozen)
    for step in range(3):
        batch = tiny_batch(seed=step)
        for m, o in ((ref, ref_opt), (model, opt)):
            m(**batch).loss.backward()
            o.step()
            o.zero_grad()
    state = model.state_dict()
    for name, value in ref.named_parameters():
        assert (state[name] - value).abs().max() <= 1e-5 * value.abs().max(), name
    assert all(torch.equal(state[k], v) for k, v in base.items())
