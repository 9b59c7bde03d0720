"""Activation memory and FLOPs of the fake-tensor profile vs real CPU runs."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_profiler")

import torch  # noqa: E402
from helpers.models import tiny_batch, tiny_model  # noqa: E402
from profiler_reference import allocator_peak_bytes  # noqa: E402
from tierwise.profile import Profile  # noqa: E402
from tierwise_profiler.model_profile import profile_model  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("batch_size", [2, 8])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_peak_activation_within_20_percent_of_the_cpu_allocator(kind, batch_size, checkpointing):
    model = tiny_model(kind)
    batch = tiny_batch(batch=batch_size, seq=32)
    profile = profile_model(model, batch, precision="fp32", activation_checkpointing=checkpointing)
    if checkpointing:
        model.activation_checkpointing_enable()
    allocator_peak_bytes(model, batch)  # warm-up: lazy one-time allocations
    measured = allocator_peak_bytes(model, batch)
    assert measured > 0
    assert profile.peak_activation_bytes == pytest.approx(measured, rel=0.2)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_activation_bytes_scale_linearly_with_batch(kind):
    model = tiny_model(kind)
    saved = {}
    peak = {}
    for batch_size in (2, 4, 8):
        profile = profile_model(model, tiny_batch(batch=batch_size, seq=32), precision="fp32")
        saved[batch_size] = sum(profile.layer_activation_bytes.values())
        peak[batch_size] = profile.peak_activation_bytes
    # bytes = a + b·batch: the step from 2 to 4 equals the step from 4 to 8 halved
    assert saved[8] - saved[4] == pytest.approx(2 * (saved[4] - saved[2]), rel=0.02)
    assert peak[8] - peak[4] == pytest.approx(2 * (peak[4] - peak[2]), rel=0.02)
    assert saved[8] > 3 * saved[2]


def test_compute_precision_sets_activation_bytes():
    model = tiny_model("llama")
    batch = tiny_batch(batch=4, seq=32)
    fp32 = profile_model(model, batch, precision="fp32")
    bf16 = profile_model(model, batch, precision="bf16")
    # the loss upcasts logits to fp32 in both; everything else halves
    assert 0.5 < bf16.peak_activation_bytes / fp32.peak_activation_bytes < 0.8


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_forward_flops_match_torch_flop_counter_on_a_real_forward(kind):
    model = tiny_model(kind)
    batch = tiny_batch(batch=4, seq=32)
    profile = profile_model(model, batch, precision="fp32")
    counter = FlopCounterMode(display=False)
    with counter:
        model(**batch)
    expected = counter.get_total_flops()
    if kind == "mixtral":  # torch does not count grouped matmuls: add 2·rows·K·N per expert pass
        tokens = 4 * 32 * model.config.num_experts_per_tok
        hidden, inner = model.config.hidden_size, model.config.intermediate_size
        expected += model.config.num_hidden_layers * 2 * tokens * hidden * 3 * inner
    assert sum(profile.layer_flops.values()) == expected
    per_layer = profile.layer_flops
    assert per_layer["lm_head"] == 2 * 4 * 32 * model.config.hidden_size * model.config.vocab_size


def test_buffers_are_counted_once():
    model = tiny_model("llama")
    expected = sum(b.numel() * b.element_size() for b in model.buffers())
    assert expected > 0
    assert profile_model(model, tiny_batch(), precision="fp32").buffer_bytes == expected


def test_profile_json_round_trip(tmp_path):
    profile = profile_model(tiny_model("gpt2"), tiny_batch(), activation_checkpointing=True)
    path = tmp_path / "profile.json"
    profile.to_json(path)
    again = Profile.from_json(path)
    assert again == profile
    assert again.params[0].shape == profile.params[0].shape
    assert isinstance(again.params[0].shape, tuple)
    assert again.source == "meta" and again.batch_size == 2 and again.seq_len == 16


def test_meta_model_profiles_without_allocating():
    import transformers
    from helpers.models import _config

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    batch = {k: v.to("meta") for k, v in tiny_batch().items()}
    on_meta = profile_model(model, batch, precision="fp32")
    on_cpu = profile_model(tiny_model("llama"), tiny_batch(), precision="fp32")
    assert on_meta.peak_activation_bytes == on_cpu.peak_activation_bytes
    assert on_meta.forward_order == on_cpu.forward_order
    assert all(p.is_meta for p in model.parameters())
