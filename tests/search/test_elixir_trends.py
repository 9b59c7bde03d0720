"""The trends Elixir (Huang et al. 2023) reports for its GPT-2 configurations, on its development
server, as the search predicts them.

Configurations (Elixir's benchmark scripts): hidden 3072/4096/8192/8192 with 32/48/18/24 layers
(GPT2-4B/10B/15B/20B), sequence 1024, batch 4/8/12/16, activation checkpointing. Hardware: one
40 GB GPU, host->device 22 GB/s, device->host 16 GB/s, GPU Adam 50 GB/s and CPU Adam 5 GB/s of
fp32 parameters (12.5e9 and 1.25e9 elements/s), 312 TFLOP/s; 2 and 4 GPUs talk at 201 and 58 GB/s
(the paper's table). Gradients are reduce-scattered chunk by chunk, as in Elixir
(gradient_staging="streaming"). Profiles are the search's analytic ones (no profiler needed).
"""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_search")
pytest.importorskip("transformers")

from tierwise import Config, Hardware  # noqa: E402
from tierwise_search.hf_profile import meta_model, profile_hf_config  # noqa: E402
from tierwise_search.search import search_plan  # noqa: E402

MODELS = {  # name: (hidden, layers, heads)
    "gpt2-4b": (3072, 32, 24),
    "gpt2-10b": (4096, 48, 32),
    "gpt2-15b": (8192, 18, 64),
    "gpt2-20b": (8192, 24, 64),
}
INTERCONNECT = {2: 201e9, 4: 58e9}


def development_server(gpus: int = 1) -> Hardware:
    return Hardware(
        device_type="cuda",
        device_memory=40 * 10**9,
        host_memory=None,
        h2d_bandwidth=22e9,
        d2h_bandwidth=16e9,
        device_adam_velocity=50e9 / 4,
        host_adam_velocity=5e9 / 4,
        device_flops=312e12,
        interconnect_bandwidth=INTERCONNECT.get(gpus),
        world_size=gpus,
    )


@pytest.fixture(scope="module")
def models():
    import transformers

    built = {}
    for name, (hidden, layers, heads) in MODELS.items():
        config = transformers.GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=50257, n_positions=1024
        )
        built[name] = (config, meta_model(config))
    return built


def plan(models, name: str, batch: int, gpus: int = 1):
    config, model = models[name]
    profile = profile_hf_config(
        config, batch=batch, seq_len=1024, precision="fp16", checkpointing=True, model=model
    )
    return search_plan(
        profile,
        development_server(gpus),
        Config(device="cpu", precision="fp16", activation_checkpointing=True),
        gradient_staging="streaming",
    )


def device_share(plan) -> float:
    """Share of the chunks whose parameters live on the device."""
    tiers = [t for group in plan.param_tiers.values() for t in group]
    return tiers.count("device") / len(tiers)


def test_predicted_throughput_rises_with_batch_size(models):
    for name in ("gpt2-4b", "gpt2-10b"):
        tflops = [plan(models, name, batch).predicted_tflops for batch in (4, 8, 12, 16)]
        assert all(a < b for a, b in zip(tflops, tflops[1:], strict=False)), (name, tflops)


def test_a_larger_model_at_the_same_memory_offloads_more(models):
    shares = [device_share(plan(models, name, 8)) for name in MODELS]
    assert all(a >= b for a, b in zip(shares, shares[1:], strict=False)), shares
    assert shares[0] > shares[-1], shares


def test_more_gpus_keep_more_chunks_on_the_devices(models):
    shares = [device_share(plan(models, "gpt2-10b", 8, gpus)) for gpus in (1, 2, 4)]
    assert shares[0] < shares[1] < shares[2], shares
