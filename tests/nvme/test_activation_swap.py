"""Activations swapped to NVMe through tierwise-nvme's asynchronous tier."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.block_stack import block_bytes, gradients  # noqa: E402
from helpers.devices import ONLY_CUDA, deterministic  # noqa: E402
from helpers.models import tiny_batch, tiny_model  # noqa: E402
from helpers.process_memory import TOLERANCE, assert_within_ledger, gpt2_growth  # noqa: E402
from helpers.train import run_tierwise, train  # noqa: E402
from nvme_helpers import FailingBackend, swap_files  # noqa: E402
from tierwise.runtime.activations import manager as manager_module  # noqa: E402
from tierwise.tiers import ledger  # noqa: E402
from tierwise_nvme import NVMeIOError, NVMeSpaceError  # noqa: E402

MIXED = {
    "gpt2": {"transformer.h.0": "nvme", "transformer.h.1": "recompute"},
    "llama": {"model.layers.0": "host", "model.layers.1": "nvme"},
}


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_nvme_and_mixed_policies_train_bitwise_like_keep(nvme_dir, kind, precision):
    kw = dict(precision=precision, device="cpu")
    base_losses, base = run_tierwise(kind, 4, **kw)
    for cfg in (dict(activation_offload="nvme"), dict(activation_policy=MIXED[kind])):
        losses, model = run_tierwise(kind, 4, nvme_path=str(nvme_dir), **kw, **cfg)
        assert losses == base_losses, cfg
        assert _same(model, base), cfg
        stats = tierwise.engine_of(model).stats()
        assert stats["activations"]["swapped_out_bytes"]["nvme"] > 0
        assert stats["activations"]["swapped_in_bytes"] == stats["activations"]["swapped_out_bytes"]
        assert stats["moved_bytes"]["act:device->nvme"] == stats["moved_bytes"]["act:nvme->device"]
        tierwise.engine_of(model).close()


def test_no_leak_over_20_steps_and_swap_files_gone_after_close(nvme_dir):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        device="cpu",
        precision="fp32",
        activation_offload="nvme",
        nvme_path=str(nvme_dir),
    )
    engine = tierwise.engine_of(model)
    for step in range(20):
        train(model, opt, 1, first_seed=step)
        assert engine.activations.swapped_now() == {"device": 0, "host": 0, "nvme": 0}
        assert engine.tiers["nvme"].used_bytes == 0
    assert any("activation" in name for name in swap_files(nvme_dir))
    engine.close()
    assert swap_files(nvme_dir) == []


@pytest.fixture
def failing_io(monkeypatch):
    """Every nvme tier created from now on goes through a FailingBackend (armed by the test)."""
    import tierwise_nvme.tier as tier_module

    made = []
    real = tier_module.open_backend

    def open_failing(options, directory):
        made.append(FailingBackend(real(options, directory), fail_at=None))
        return made[-1]

    monkeypatch.setattr(tier_module, "open_backend", open_failing)
    return made


def _activation_write(request) -> bool:
    return request.op == "write" and "activation" in request.path


@pytest.mark.parametrize("code, error", [(errno.EIO, NVMeIOError), (errno.ENOSPC, NVMeSpaceError)])
def test_failed_swap_out_is_a_clear_error_and_the_engine_goes_on(nvme_dir, failing_io, code, error):
    kw = dict(precision="fp32", device="cpu")
    base_losses, base = run_tierwise("llama", 3, **kw)
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(
        model, opt, activation_offload="nvme", nvme_path=str(nvme_dir), **kw
    )
    engine = tierwise.engine_of(model)
    losses = train(model, opt, 1)
    for io in failing_io:
        io.code = code
        io.fail_if = _activation_write
    with pytest.raises(
        error, match=r"nvme tier: write of \d+ bytes at offset \d+ in .*activation"
    ) as info:
        model(**tiny_batch(seed=1)).loss.backward()
    assert any("block model.layers" in note for note in getattr(info.value, "__notes__", []))
    assert engine.activations.swapped_now() == {"device": 0, "host": 0, "nvme": 0}
    assert engine.tiers["nvme"].used_bytes == 0
    opt.zero_grad()  # nothing of the failed step was applied: the same step again
    losses += train(model, opt, 2, first_seed=1)
    assert losses == base_losses
    assert _same(model, base)
    engine.close()


def _activation_read(request) -> bool:
    return request.op == "read" and "activation" in request.path


def test_failed_swap_in_drops_the_step_and_the_engine_goes_on(nvme_dir, failing_io):
    kw = dict(precision="fp32", device="cpu")
    base_losses, base = run_tierwise("llama", 3, **kw)
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(
        model, opt, activation_offload="nvme", nvme_path=str(nvme_dir), **kw
    )
    engine = tierwise.engine_of(model)
    losses = train(model, opt, 1)
    for io in failing_io:
        io.fail_if = _activation_read
    with pytest.raises(
        NVMeIOError, match=r"nvme tier: read of \d+ bytes at offset \d+ in .*activation"
    ) as info:
        model(**tiny_batch(seed=1)).loss.backward()
    assert any(io.failed is not None for io in failing_io)  # the error came from the swap-in
    assert any("swapping in" in note for note in getattr(info.value, "__notes__", []))
    assert engine.activations.swapped_now() == {"device": 0, "host": 0, "nvme": 0}
    assert engine.tiers["nvme"].used_bytes == 0
    with pytest.raises(RuntimeError, match="backward failed .* zero_grad"):
        opt.step()  # the partial gradient never reaches the optimizer
    opt.zero_grad()
    losses += train(model, opt, 2, first_seed=1)
    assert losses == base_losses
    assert _same(model, base)
    engine.close()


RSS_CHILD = r"""
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
import torch, tierwise
import transformers as tf

def hwm_and_rss():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmHWM"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024

config = tf.GPT2Config(n_embd=64, n_layer=8, n_head=2, vocab_size=128, n_positions=512,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
config._attn_implementation = "eager"
torch.manual_seed(0)
model = tf.AutoModelForCausalLM.from_config(config).train()
opt = torch.optim.AdamW(model.parameters())
settings = json.loads(sys.argv[1])
model, opt = tierwise.setup(model, opt, device="cpu", precision="fp32", **settings)
ids = torch.randint(0, 128, (4, 512), generator=torch.Generator().manual_seed(0))
_, setup_rss = hwm_and_rss()
growth, seconds, faults = [], [], []
for step in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak RSS (VmHWM) to now
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    seconds.append(time.perf_counter() - start)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
    peak, _ = hwm_and_rss()
    growth.append(peak - setup_rss)
engine = tierwise.engine_of(model)
print(json.dumps({"growth": growth[1:], "seconds": seconds[1:], "minor_faults": faults[1:],
                  "swapped": engine.stats()["activations"]["swapped_out_bytes"],
                  "large_blocks_unmapped": engine.activations.large_blocks_unmapped}))
"""
"""Peak RSS of each step over the RSS setup left (steps after the first: the first also makes
the optimizer's states), with glibc malloc's defaults: the peak of a step, not the growth within
it, because glibc keeps what an earlier step freed resident ([Note: swapped activations' freed
memory] in tierwise.tiers.ledger)."""


def _peak_rss_growth(settings: dict) -> dict:
    import json
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MALLOC_MMAP_THRESHOLD_", None)  # glibc's defaults: what a user gets
    done = subprocess.run(
        [sys.executable, "-c", RSS_CHILD, json.dumps(settings)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_nvme_swap_at_least_halves_the_peak_rss_growth_of_a_step(nvme_dir):
    try:
        open("/proc/self/clear_refs", "w").write("5")
    except OSError as err:
        pytest.skip(f"cannot reset the peak RSS here ({err})")
    keep = _peak_rss_growth({})
    nvme = _peak_rss_growth({"activation_offload": "nvme", "nvme_path": str(nvme_dir)})
    assert keep["swapped"] == {"host": 0, "nvme": 0} and nvme["swapped"]["nvme"] > 0
    assert not keep["large_blocks_unmapped"]  # a plan that does not swap leaves malloc alone
    assert max(nvme["growth"]) <= min(keep["growth"]) / 2, (keep, nvme)


def test_unmapping_large_blocks_is_a_no_op_without_glibc(monkeypatch):
    """musl and macOS: the C library is not glibc, nothing is set and the swaps still work."""
    import ctypes.util

    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert ledger.keep_large_blocks_off_the_heap() is False
    monkeypatch.undo()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the user's own choice stays
    assert ledger.keep_large_blocks_off_the_heap() is False


def test_only_cpu_plans_swapping_to_nvme_set_the_malloc_threshold(monkeypatch, nvme_dir):
    calls = []
    monkeypatch.setattr(
        manager_module, "keep_large_blocks_off_the_heap", lambda: calls.append(1) or True
    )
    for settings, expected in (
        ({}, 0),
        ({"activation_offload": "nvme", "nvme_path": str(nvme_dir)}, 1),
    ):
        model = tiny_model("gpt2")
        opt = torch.optim.AdamW(model.parameters())
        model, opt = tierwise.setup(model, opt, device="cpu", precision="fp32", **settings)
        engine = tierwise.engine_of(model)
        assert engine.activations.large_blocks_unmapped is bool(expected), settings
        assert len(calls) == expected, settings
        calls.clear()
        engine.close()


@pytest.mark.parametrize("device", ONLY_CUDA)
def test_cuda_nvme_swaps_through_a_tiny_pinned_pool_leave_the_gradients(make_tier, device):
    """CUDA -> pinned staging -> disk with a pool of one block's bytes: a full pool first lands
    the oldest swap-outs to disk (their staging buffers come back) and only then falls back to
    unpinned buffers; the gradients stay those of the plain model ([Note: bounded pinned
    buffers] in tierwise.runtime.activations.pinned_pool)."""
    shape = dict(rows=256, width=512, depth=4)
    one_block = block_bytes(shape["rows"], shape["width"])
    with deterministic(device):
        reference, _ = gradients(device, **shape)
        tier = make_tier("libaio", device=device)
        grads, stats = gradients(device, **shape, policy="nvme", nvme=tier, pinned_bytes=one_block)
    assert all(torch.equal(grads[k], reference[k]) for k in reference)
    assert stats["swapped_out_bytes"]["nvme"] == shape["depth"] * one_block
    assert stats["host_buffers"]["waits"] + stats["host_buffers"]["refused"] > 0
    assert 0 < stats["host_buffers"]["high_water_bytes"] <= one_block
    assert tier.used_bytes == 0


def test_swaps_pageable_host_buffers_are_in_the_ledger_and_freed_by_the_step(nvme_dir):
    """A CPU device's host swaps (copies) and nvme swap-ins (page-aligned buffers) are host RAM
    the ledger counts in ``activation_pageable_buffers`` ([Note: the memory ledger]); the
    backward frees them."""
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        device="cpu",
        precision="fp32",
        activation_policy=MIXED["llama"],
        nvme_path=str(nvme_dir),
    )
    engine = tierwise.engine_of(model)
    train(model, opt, 2)
    stats = engine.stats()
    swapped = stats["activations"]["swapped_out_bytes"]
    assert swapped["host"] > 0 and swapped["nvme"] > 0
    entry = stats["memory"]["activation_pageable_buffers"]
    assert entry["memory"] == "host" and entry["within"] is None and not entry["pinned"]
    # the host copies live together from their block's forward to its backward
    assert entry["peak_bytes"] >= swapped["host"]
    assert entry["bytes"] == 0
    engine.close()


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs /proc/self/clear_refs"
)
def test_the_ledger_explains_the_peak_rss_growth_with_activations_on_nvme(nvme_dir):
    record = gpt2_growth(
        f'precision="bf16", param_placement="host", optimizer_placement="host", '
        f'activation_offload="nvme", nvme_path={str(nvme_dir)!r}'
    )
    assert record["ledger"]["activation_pageable_buffers"]["peak_bytes"] > 0
    assert_within_ledger(record, tolerance=TOLERANCE, what="3 steps with activations on nvme")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_recompute_from_nvme_inputs_trains_bitwise_like_keep(nvme_dir, kind):
    """``recompute_nvme`` on every block ([Note: recompute from swapped inputs]): the inputs each
    block's checkpoint saves go to nvme and back once a step, the training is keep's."""
    kw = dict(precision="fp32", device="cpu")
    blocks = "transformer.h.*" if kind == "gpt2" else "model.layers.*"
    base_losses, base = run_tierwise(kind, 2, **kw)
    losses, model = run_tierwise(
        kind, 2, nvme_path=str(nvme_dir), activation_policy={blocks: "recompute_nvme"}, **kw
    )
    assert losses == base_losses and _same(model, base)
    engine = tierwise.engine_of(model)
    act = engine.stats()["activations"]
    # by hand: each block's fp32 hidden states (b x s x h), and GPT-2's float causal mask
    # (b x 1 x s x s), which it hands every block positionally
    b, s, h = 2, 16, model.config.hidden_size
    per_block = 4 * b * s * h + (4 * b * s * s if kind == "gpt2" else 0)
    assert act["swapped_out_bytes"] == {"host": 0, "nvme": 2 * per_block}
    assert act["swapped_in_bytes"] == act["swapped_out_bytes"]
    assert (act["recomputed_blocks"], act["saved_peak_bytes"]) == (2, 0)
    assert engine.activations.swapped_now() == {"device": 0, "host": 0, "nvme": 0}
    engine.close()
