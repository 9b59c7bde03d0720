"""Activation policy at runtime: keep / recompute / host swap per block (nvme: tests/nvme)."""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from helpers.train import run_tierwise, train
from tierwise.config import ConfigError

POLICIES = {
    "keep": dict(),
    "recompute-all": dict(activation_checkpointing=True),
    "host": dict(activation_offload="host"),
    "auto": dict(activation_offload="auto"),
}
MIXED = {  # block names differ per model family
    "gpt2": {"transformer.h.0": "recompute", "transformer.h.1": "host"},
    "llama": {"model.layers.0": "host", "model.layers.1": "recompute"},
}


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_every_activation_policy_trains_bitwise_alike(kind, precision):
    runs = {
        name: run_tierwise(kind, 4, precision=precision, device="cpu", **cfg)
        for name, cfg in POLICIES.items()
    }
    runs["mixed"] = run_tierwise(
        kind, 4, precision=precision, device="cpu", activation_policy=MIXED[kind]
    )
    base_losses, base = runs["keep"]
    for name, (losses, model) in runs.items():
        assert losses == base_losses, name
        assert _same(model, base), name
    stats = {name: tierwise.engine_of(m).stats()["activations"] for name, (_, m) in runs.items()}
    assert stats["keep"]["policy"] == {"keep": 2}
    assert stats["recompute-all"]["recomputed_blocks"] == 2
    assert stats["host"]["swapped_out_bytes"]["host"] > 0
    assert stats["host"]["swapped_in_bytes"] == stats["host"]["swapped_out_bytes"]
    assert stats["mixed"]["policy"] == {"recompute": 1, "host": 1}
    assert stats["mixed"]["recomputed_blocks"] == 1
    moved = tierwise.engine_of(runs["host"][1]).stats()["moved_bytes"]
    assert moved["act:device->host"] == moved["act:host->device"] > 0


FP16_POLICIES = {
    "host": dict(activation_offload="host"),
    "auto": dict(activation_offload="auto"),
    "recompute-all": dict(activation_checkpointing=True),
}


@pytest.fixture
def one_thread():
    """One intra-op thread: CPU fp16 matmuls of different layouts round differently there, which
    is how a KV cache built under keep but not under recompute once showed ([Note: no KV cache
    in training])."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_fp16_loss_scaled_training_is_bitwise_alike_under_every_policy(one_thread):
    kw = dict(precision="fp16", device="cpu")
    base_losses, base = run_tierwise("gpt2", 4, **kw)
    for name, cfg in FP16_POLICIES.items():
        losses, model = run_tierwise("gpt2", 4, **kw, **cfg)
        assert losses == base_losses, name
        assert _same(model, base), name
        stats, base_stats = tierwise.engine_of(model).stats(), tierwise.engine_of(base).stats()
        assert (stats["loss_scale"], stats["skipped_steps"]) == (
            base_stats["loss_scale"],
            base_stats["skipped_steps"],
        ), name
        if name == "host":
            assert stats["activations"]["swapped_out_bytes"]["host"] > 0
        if name == "recompute-all":
            assert stats["activations"]["recomputed_blocks"] == 2


@pytest.mark.parametrize("policy", [{}, {"activation_checkpointing": True}])
def test_training_forwards_build_no_kv_cache_under_any_policy_and_inference_keeps_it(policy):
    model = tiny_model("llama")
    assert model.config.use_cache  # HF's default: a cache in every forward, training too
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(model, opt, device="cpu", precision="fp32", **policy)
    out = model(**tiny_batch())
    assert _kv_cache(out) is None
    out.loss.backward()
    opt.zero_grad()
    with torch.no_grad():  # inference keeps the caller's choice
        assert _kv_cache(model(**tiny_batch(), use_cache=True)) is not None


def _kv_cache(output):
    """The KV cache an HF output returned (transformers 5 renamed past_key_values to cache)."""
    return output.get("cache", output.get("past_key_values"))


def _reference_swap_bytes(kind: str, blocks: list[str], min_bytes: int = 1024) -> int:
    """Bytes a swap of ``blocks`` must move in one step of the plain model, counted with plain
    saved_tensors_hooks: storages (once per block) that are not parameters' and >= min_bytes."""
    model = tiny_model(kind)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total, seen, contexts = [0], set(), []

    def pack(tensor):
        storage = tensor.untyped_storage()
        if (
            storage.data_ptr() not in param_storages
            and storage.nbytes() >= min_bytes
            and storage.data_ptr() not in seen
        ):
            seen.add(storage.data_ptr())
            total[0] += storage.nbytes()
        return tensor

    def enter(module, args):
        seen.clear()
        contexts.append(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        contexts[-1].__enter__()

    def leave(module, args, output):
        contexts.pop().__exit__(None, None, None)

    modules = dict(model.named_modules())
    for name in blocks:
        modules[name].register_forward_pre_hook(enter)
        modules[name].register_forward_hook(leave)
    model(**tiny_batch()).loss.backward()
    return total[0]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_swapped_bytes_equal_a_plain_saved_tensors_hooks_count(kind):
    block = MIXED[kind] and next(b for b, a in MIXED[kind].items() if a == "host")
    _, model = run_tierwise(
        kind, 1, precision="fp32", device="cpu", activation_policy={block: "host"}
    )
    stats = tierwise.engine_of(model).stats()["activations"]
    expected = _reference_swap_bytes(kind, [block])
    assert expected > 0
    assert stats["swapped_out_bytes"] == {"host": expected, "nvme": 0}


def test_host_swap_leaves_nothing_between_steps_for_20_steps():
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model, opt, device="cpu", precision="fp32", activation_offload="host"
    )
    engine = tierwise.engine_of(model)
    for step in range(20):
        train(model, opt, 1, first_seed=step)
        assert engine.activations.swapped_now() == {"device": 0, "host": 0, "nvme": 0}
        assert engine.stats()["activations"]["swapped_out_bytes"]["host"] > 0


def test_gradient_accumulation_with_swaps_matches_keep():
    kw = dict(precision="fp32", device="cpu", train_kwargs=dict(accum=3))
    base_losses, base = run_tierwise("llama", 3, **kw)
    losses, model = run_tierwise("llama", 3, activation_policy={"*": "host"}, **kw)
    assert losses == base_losses and _same(model, base)


def test_nothing_is_swapped_under_no_grad():
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model, opt, device="cpu", precision="fp32", activation_offload="host"
    )
    engine = tierwise.engine_of(model)
    with torch.no_grad():
        model(**tiny_batch())
    opt.step()
    assert engine.stats()["activations"]["swapped_out_bytes"] == {"host": 0, "nvme": 0}
    assert engine.activations.moved_bytes == {}


def _count_mlp_calls(model) -> list[int]:
    """MLP forward starts (a pre-hook: a recompute may stop early, before post-hooks)."""
    calls = [0]
    for name, module in model.named_modules():
        if name.endswith(".mlp"):
            module.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("user_enabled", [False, True])
def test_recompute_composes_with_hf_checkpointing_without_double_recompute(user_enabled):
    base_losses, base = run_tierwise("llama", 2, precision="fp32", device="cpu")
    model = tiny_model("llama")
    if user_enabled:  # the user turned on HF's own checkpointing before setup
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(
        model, opt, device="cpu", precision="fp32", activation_policy={"model.layers.1": "host"}
    )
    calls = _count_mlp_calls(model)
    losses = train(model, opt, 2)
    assert losses == base_losses and _same(model, base)
    # block 0: forward + one recompute if the user asked for checkpointing; block 1: forward
    assert calls[0] == 2 * (3 if user_enabled else 2)
    stats = tierwise.engine_of(model).stats()["activations"]
    assert stats["recomputed_blocks"] == (1 if user_enabled else 0)


def test_a_pattern_matching_no_block_lists_the_blocks():
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(
        ConfigError,
        match=r"'model\.layers\.\*' matches no transformer block; "
        r"the blocks are: transformer\.h\.0, transformer\.h\.1",
    ):
        tierwise.setup(model, opt, device="cpu", activation_policy={"model.layers.*": "host"})
    # nothing was changed: the model can still be set up
    tierwise.setup(model, opt, device="cpu", activation_policy={"transformer.h.*": "host"})


@pytest.mark.parametrize(
    "policy, match",
    [
        ({"transformer.h.0": "disk"}, r"'disk': choose one of keep, recompute, host, nvme"),
        (["transformer.h.0"], r"give a dict of block name or pattern to action"),
        ({"transformer.h.0": "nvme"}, r"needs nvme_path"),
    ],
)
def test_bad_activation_policies_are_one_line_errors(policy, match):
    with pytest.raises(ConfigError, match=match):
        tierwise.Config(device="cpu", activation_policy=policy)


def test_nvme_activation_offload_without_nvme_path_names_the_path_and_the_plugin():
    with pytest.raises(
        ConfigError,
        match=r"^Config\.activation_offload='nvme': .*needs nvme_path "
        r"set to a directory on a fast disk \(and the tierwise-nvme plugin\)$",
    ):
        tierwise.Config(device="cpu", activation_offload="nvme")


def _stack_profile(blocks: int, numel: int, act: int):
    from tierwise import ParamInfo, Profile

    names = [f"layers.{b}.w" for b in range(blocks)]
    return Profile(
        params=[ParamInfo(name=n, shape=(numel,), numel=numel) for n in names],
        forward_order=names,
        backward_order=names[::-1],
        module_params={n[:-2]: [n] for n in names},
        layer_activation_bytes={f"layers.{b}": act for b in range(blocks)},
        peak_activation_bytes=blocks * act,
    )


def test_core_auto_recomputes_blocks_only_when_keeping_them_pushes_model_data_off_the_device():
    from tierwise import Config, Hardware
    from tierwise.planning.planner import default_plan

    profile = _stack_profile(4, 1 << 20, 100 << 20)  # model data 4 Mi elements, activations 400 MiB
    need = 4 * (1 << 20) * (2 + 14)  # bf16 params + fp32 master/moments + bf16 grads: 64 MiB

    def plan_for(capacity):
        return default_plan(
            profile=profile,
            config=Config(device="cpu", activation_offload="auto"),
            hardware=Hardware(device_type="cuda", device_memory=capacity),
        )

    roomy = plan_for(2 * (400 << 20) + 4 * need)
    assert set(roomy.activation_policy.values()) == {"keep"}
    assert roomy.param_tier == roomy.optim_tier == "device"
    tight = plan_for(int(1.25 * (400 << 20)) + need // 2)  # keeping them leaves no room
    assert tight.activation_policy == {f"layers.{b}": "recompute" for b in range(4)}
    assert tight.param_tier == tight.optim_tier == "device"
    assert any("recompute all 4 blocks" in r for r in tight.reasons)


def test_saved_activations_over_the_plans_allotment_name_the_block():
    from tierwise.plan import PlanError

    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model, opt, device="cpu", precision="fp32", activation_policy={"transformer.h.0": "host"}
    )
    engine = tierwise.engine_of(model)
    engine.activations.allowance = 4096  # as a plan that under-counted activations would
    with pytest.raises(
        PlanError,
        match=r"over the 4\.00 KiB the plan allotted them \(Invariant 4\); "
        r"block transformer\.h\.1 keeps the most",
    ):
        model(**tiny_batch())
    assert engine.activations.swapped_now() == {"device": 0, "host": 0, "nvme": 0}
    engine.activations.allowance = None
    train(model, opt, 1)


def test_a_second_backward_through_a_swapped_block_is_a_clear_error():
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model, opt, device="cpu", precision="fp32", activation_policy={"transformer.h.1": "host"}
    )
    loss = model(**tiny_batch()).loss
    loss.backward(retain_graph=True)
    with pytest.raises(
        RuntimeError,
        match=r"block transformer\.h\.1 swapped to host were already "
        r"used by a backward",
    ):
        loss.backward()


def test_the_memory_trace_and_plot_show_swapped_activations(tmp_path, monkeypatch):
    from tierwise.train.plot import plot_memory
    from tierwise.train.trace import StepTracer

    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model, opt, device="cpu", precision="fp32", activation_offload="host"
    )
    engine = tierwise.engine_of(model)
    train(model, opt, 1)  # the warm-up step
    tracer = StepTracer(model, engine.stats, step=2, budgets={"device": None})
    tracer.mark("forward", "step starts")
    with tracer.forward():
        loss = model(**tiny_batch()).loss
    loss.backward()
    tracer.backward_finished()
    opt.step()
    opt.zero_grad()
    tracer.mark("optimizer", "optimizer step done")
    swapped = {s.label: s.swapped_bytes.get("host", 0) for s in tracer.trace.samples}
    # after the last block's forward every block's saved tensors are on the host, as many bytes
    # as a plain saved_tensors_hooks count of the blocks gives; nothing before or after the step
    everything = _reference_swap_bytes("gpt2", ["transformer.h.0", "transformer.h.1"])
    assert 0 < swapped["block 0 forward"] < swapped["block 1 forward"] == everything
    assert swapped["step starts"] == swapped["optimizer step done"] == 0
    figures = []
    monkeypatch.setattr(
        "matplotlib.figure.Figure.savefig", lambda fig, *a, **k: figures.append(fig)
    )
    assert plot_memory(tmp_path / "memory.png", tracer.trace, [], title="host swap") is None
    labels = [text.get_text() for text in figures[0].axes[0].get_legend().get_texts()]
    assert "activations swapped to host" in labels
