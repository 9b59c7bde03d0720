"""setup(weights=...) loads a save_pretrained checkpoint straight into chunks (issue 26): on each
tier and on 2 ranks the parameters are bitwise the checkpoint's (as HF's from_pretrained reads
it, legacy MoE layouts converted) and the first forward's logits equal HF's; bad checkpoints are
one-line errors that leave the model and the tiers as they were; host memory while loading is
one tensor, not the model."""

from __future__ import annotations

import os

import pytest
import safetensors.torch
import tierwise
import torch
import transformers
from helpers.models import _config, tiny_model
from helpers.multiproc import run_ranks
from tierwise.weights import READS, WeightsError

FAMILIES = ("gpt2", "llama", "opt", "qwen2_moe")
IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))
OPTIONS = dict(precision="fp32", device="cpu", chunk_size=4096, cache_blocks=6)


def save_checkpoint(family: str, folder, config: dict | None = None, **save) -> None:
    model = tiny_model(family, seed=0, **(config or {}))
    model.config._attn_implementation = "eager"
    model.save_pretrained(folder, **save)


def meta_model(family: str, **config) -> torch.nn.Module:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            _config(family, **config), attn_implementation="eager"
        )
    return model


def hf_reference(folder) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def load(family: str, folder, config: dict | None = None, **options):
    model = meta_model(family, **(config or {}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return tierwise.setup(model, optimizer, weights=folder, **{**OPTIONS, **options})


def assert_matches_hf(model, reference) -> None:
    state, expected = model.state_dict(), reference.state_dict()
    params = {n for n, _ in reference.named_parameters(remove_duplicate=False)}
    for name in params:
        assert torch.equal(state[name], expected[name]), name
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, reference(input_ids=IDS).logits)


@pytest.mark.parametrize("placement", ["host", "device"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_loads_bitwise_into_chunks_and_gives_hf_logits(tmp_path, family, placement):
    save_checkpoint(family, tmp_path)
    model, _ = load(family, tmp_path, param_placement=placement, optimizer_placement=placement)
    assert_matches_hf(model, hf_reference(tmp_path))


@pytest.mark.combined
@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_loads_into_chunks_on_nvme(tmp_path, family):
    save_checkpoint(family, tmp_path / "ckpt")
    nvme = tmp_path / "nvme"
    model, _ = load(
        family,
        tmp_path / "ckpt",
        param_placement="nvme",
        optimizer_placement="nvme",
        nvme_path=str(nvme),
    )
    assert_matches_hf(model, hf_reference(tmp_path / "ckpt"))
    tierwise.save_pretrained(model, tmp_path / "out", max_shard_size="20KB")
    assert_matches_hf(model, hf_reference(tmp_path / "out"))  # streamed out of NVMe chunks


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_streams_the_chunks_into_shards_transformers_loads(tmp_path, family):
    save_checkpoint(family, tmp_path / "in")
    model, optimizer = load(
        family, tmp_path / "in", param_placement="host", optimizer_placement="host"
    )
    model(input_ids=IDS, labels=IDS).loss.backward()  # values of its own, not the checkpoint's
    optimizer.step()
    model.save_pretrained(tmp_path / "out", max_shard_size="20KB")
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    reloaded, before = hf_reference(tmp_path / "out"), hf_reference(tmp_path / "in")
    state = model.state_dict()
    for name, value in reloaded.named_parameters():
        assert torch.equal(state[name], value), name
    assert not torch.equal(reloaded.lm_head.weight, before.lm_head.weight)


def test_bf16_chunks_get_the_checkpoint_in_bf16_and_a_bf16_checkpoint_converts_up(tmp_path):
    save_checkpoint("llama", tmp_path / "fp32")
    model, _ = load("llama", tmp_path / "fp32", precision="bf16")
    reference = hf_reference(tmp_path / "fp32")
    state = model.state_dict()  # the fp32 masters
    for name, param in reference.named_parameters():
        assert torch.equal(state[name], param), name
    params = dict(model.named_parameters())  # the chunks' compute copies
    for name, param in reference.named_parameters():
        assert params[name].dtype == torch.bfloat16
        assert torch.equal(params[name].detach(), param.to(torch.bfloat16)), name

    tiny_model("llama", seed=0).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model, _ = load("llama", tmp_path / "bf16")
    stored = safetensors.torch.load_file(tmp_path / "bf16" / "model.safetensors")
    for name, value in model.state_dict().items():
        if name in stored:
            assert torch.equal(value, stored[name].float()), name


def test_sharded_checkpoint_loads_with_host_memory_of_one_tensor(tmp_path):
    save_checkpoint("llama", tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    files = list(tmp_path.glob("model-*.safetensors"))
    assert len(files) > 2
    stored = {}
    for file in files:
        stored.update(safetensors.torch.load_file(file))
    largest = max(v.numel() * v.element_size() for v in stored.values())
    total = sum(v.numel() * v.element_size() for v in stored.values())
    READS.reset()
    model, _ = load("llama", tmp_path, param_placement="host", optimizer_placement="host")
    # every buffer the read path hands out is released before the next tensor is read
    assert READS.peak <= largest < total / 4
    assert_matches_hf(model, hf_reference(tmp_path))


def test_converted_moe_experts_hold_one_layer_at_a_time(tmp_path):
    save_checkpoint("qwen2_moe", tmp_path)
    reference = hf_reference(tmp_path)
    fused = max(p.numel() * 4 for n, p in reference.named_parameters() if "experts" in n)
    total = sum(p.numel() * 4 for p in reference.parameters())
    READS.reset()
    load("qwen2_moe", tmp_path)
    # the per-expert tensors and the fused tensor stacked from them, for one layer
    assert READS.peak <= 2 * fused < total


def test_parameters_are_tied_from_one_stored_name(tmp_path):
    save_checkpoint("gpt2", tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in stored  # save_pretrained drops the tied copy
    model, _ = load("gpt2", tmp_path)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert torch.equal(model.state_dict()["lm_head.weight"], stored["transformer.wte.weight"])


def test_a_callable_or_a_state_dict_is_a_weight_source(tmp_path):
    reference = tiny_model("llama", seed=0)
    reference.config._attn_implementation = "eager"
    state = reference.state_dict()
    asked = []

    def weights(name):
        asked.append(name)
        return state[name]

    for source in (weights, state):
        model, _ = load("llama", source)
        assert_matches_hf(model, reference.eval())
    assert sorted(asked) == sorted(n for n, _ in reference.named_parameters())


def _assert_untouched(model) -> None:
    assert all(p.is_meta for p in model.parameters())
    assert not hasattr(model, "_tierwise_engine") and not tierwise.registry.managed(model)


def _error(family, folder, **options) -> str:
    model = meta_model(family)
    with pytest.raises(WeightsError) as info:
        tierwise.setup(
            model, torch.optim.AdamW(model.parameters()), weights=folder, **{**OPTIONS, **options}
        )
    _assert_untouched(model)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_and_unexpected_tensors_are_one_error_naming_them(tmp_path):
    save_checkpoint("llama", tmp_path)
    file = tmp_path / "model.safetensors"
    stored = safetensors.torch.load_file(file)
    del stored["model.layers.1.mlp.up_proj.weight"]
    stored["model.layers.7.mlp.extra.weight"] = torch.zeros(2)
    safetensors.torch.save_file(stored, file, metadata={"format": "pt"})
    message = _error("llama", tmp_path)
    assert "missing model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected model.layers.7.mlp.extra.weight" in message


def test_a_shape_mismatch_names_the_tensor(tmp_path):
    save_checkpoint("llama", tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            _config("llama", intermediate_size=80)
        )
    with pytest.raises(
        WeightsError,
        match=r"shape mismatch: checkpoint model\.layers\.0\.mlp\.gate_proj\.weight \(64, 32\), model \(80, 32\)",
    ):
        tierwise.setup(model, torch.optim.AdamW(model.parameters()), weights=tmp_path, **OPTIONS)
    _assert_untouched(model)


def test_a_truncated_shard_names_the_file(tmp_path):
    save_checkpoint("llama", tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    message = _error("llama", tmp_path)
    assert str(shard) in message and "truncated" in message


@pytest.mark.combined
def test_a_failure_while_filling_nvme_chunks_leaves_no_files(tmp_path):
    reference = tiny_model("llama", seed=0)
    state = reference.state_dict()
    last = list(state)[-1]

    def weights(name):
        if name == last:
            raise WeightsError(f"cannot read {name}")
        return state[name]

    nvme = tmp_path / "nvme"
    message = _error(
        "llama", weights, param_placement="nvme", optimizer_placement="nvme", nvme_path=str(nvme)
    )
    assert last in message
    assert not nvme.exists() or not any(p.is_file() for p in nvme.rglob("*"))


def _load_on_ranks(rank: int, world: int, folder: str) -> None:
    for family in FAMILIES:
        path = os.path.join(folder, family)
        model, _ = load(family, path, param_placement="host", optimizer_placement="host")
        assert next(tierwise.engine_of(model).chunks()).group.sharded
        assert_matches_hf(model, hf_reference(path))
        out = os.path.join(folder, f"{family}-out")
        tierwise.save_pretrained(model, out, max_shard_size="20KB")  # collective, rank 0 writes
        torch.distributed.barrier()
        assert_matches_hf(model, hf_reference(out))


def test_two_ranks_each_fill_their_shards_and_match_hf(tmp_path):
    for family in FAMILIES:
        save_checkpoint(family, tmp_path / family)
    run_ranks(_load_on_ranks, 2, str(tmp_path))


@pytest.mark.combined
def test_a_checkpoint_larger_than_host_memory_loads_when_the_placement_fits(tmp_path, monkeypatch):
    # the NVMe tier's read buffers count in host memory ([Note: storage tiers' host buffers]):
    # 4 KiB blocks fit this sub-MiB budget (one default 4 MiB block would not)
    monkeypatch.setenv("TIERWISE_NVME_BLOCK_SIZE", "4KiB")
    deeper = dict(num_hidden_layers=48)  # many small tensors: host needs scale with the largest
    save_checkpoint("llama", tmp_path / "ckpt", deeper)
    checkpoint_bytes = (tmp_path / "ckpt" / "model.safetensors").stat().st_size
    nvme = dict(
        param_placement="nvme",
        optimizer_placement="nvme",
        nvme_path=str(tmp_path / "n"),
        chunk_size=1024,
        cache_blocks="auto",
    )
    host_memory = checkpoint_bytes // 2
    model, _ = load("llama", tmp_path / "ckpt", deeper, host_memory=host_memory, **nvme)
    plan = tierwise.engine_of(model).plan
    assert 0 < plan.io_buffer_bytes < host_memory  # the plan counts the load buffers
    assert "load/save buffers (host)" in plan.table()
    host = tierwise.engine_of(model).tiers["host"]
    assert plan.io_buffer_bytes <= host.peak_bytes <= host_memory  # reserved while loading
    state, expected = model.state_dict(), hf_reference(tmp_path / "ckpt").state_dict()
    assert all(torch.equal(state[n], v) for n, v in expected.items())  # fp32 masters


@pytest.mark.combined
def test_a_plan_that_fills_host_memory_loads_with_the_room_left(tmp_path, monkeypatch):
    """The load buffers are not part of the training-time host need, so a host budget the chunks
    nearly fill leaves less room than ``Plan.io_buffer_bytes``: the load takes the room left
    (two pieces at least, [Note: load buffers fit the room left]) instead of refusing, stays
    within the budget and gives the checkpoint's values bitwise."""
    from tierwise.runtime.setup import weight_fill

    monkeypatch.setenv("TIERWISE_NVME_BLOCK_SIZE", "4KiB")
    monkeypatch.setattr(weight_fill, "FILL_PIECE", 256)  # pieces far below the largest tensor
    # the plan-time check counts the loader's least buffers in pieces of the same size
    # ([Note: the weight load checked at plan time])
    monkeypatch.setattr(tierwise.plan, "LOAD_PIECE", 256)
    deeper = dict(num_hidden_layers=8)
    save_checkpoint("llama", tmp_path / "ckpt", deeper)
    nvme = dict(param_placement="nvme", optimizer_placement="nvme", chunk_size=1024)
    roomy = (tmp_path / "ckpt" / "model.safetensors").stat().st_size
    model, _ = load("llama", tmp_path / "ckpt", deeper, host_memory=roomy,
                    nvme_path=str(tmp_path / "a"), **nvme)  # fmt: skip
    engine = tierwise.engine_of(model)
    chunks_and_pools, wanted = engine.tiers["host"].used_bytes, engine.plan.io_buffer_bytes
    least = 2 * 256 * 12  # two fp32 pieces: the values read, the master's copy, the home's
    assert least < wanted // 2
    del model, engine
    host_memory = chunks_and_pools + wanted // 2  # half the plan's load buffers fit beside
    model, _ = load("llama", tmp_path / "ckpt", deeper, host_memory=host_memory,
                    nvme_path=str(tmp_path / "b"), **nvme)  # fmt: skip
    host = tierwise.engine_of(model).tiers["host"]
    assert host.used_bytes + wanted > host_memory  # the plan's load buffers had no room
    assert host.used_bytes < host.peak_bytes <= host_memory
    state, expected = model.state_dict(), hf_reference(tmp_path / "ckpt").state_dict()
    assert all(torch.equal(state[n], v) for n, v in expected.items())  # fp32 masters


SAVE_SCRIPT = """
import sys, torch, transformers
from helpers.models import _config
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(_config("llama", **{config}))
model.save_pretrained(sys.argv[1])
"""
LOAD_SCRIPT = """
import os, sys, torch, transformers, tierwise
from helpers.models import _config
from helpers import process_memory as pm
folder = sys.argv[1]
with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(
        _config("llama", **{config}), attn_implementation="eager"
    )
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
options = dict(precision="fp32", device="cpu", param_placement="nvme", optimizer_placement="nvme",
               nvme_path=sys.argv[2], chunk_size=512 * 1024, cache_blocks="auto",
               host_memory=int(sys.argv[3]), device_memory=int(sys.argv[4]))
pm.probe_hardware_first(device="cpu", precision="fp32")
pm.start()
model, optimizer = tierwise.setup(model, optimizer, weights=folder, **options)
pm.finish(tierwise.engine_of(model).stats()["memory"])
"""


@pytest.mark.combined
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs VmHWM resets")
def test_loading_a_checkpoint_larger_than_host_memory_grows_the_process_by_its_budgets(
    tmp_path, monkeypatch
):
    """The process, not only tierwise's counters (issue 36): loading a 234 MB checkpoint into
    NVMe chunks with host memory of half of it grows the loading process's peak RSS (VmHWM, in a
    fresh process) by at most host_memory + device_memory (a CPU device is RAM) + the ledger
    tests' stated tolerance (``helpers.process_memory.TOLERANCE``: PyTorch's working memory).
    The checkpoint is larger than that bound, so a read path holding it whole fails."""
    import subprocess
    import sys

    from helpers.process_memory import TESTS, TOLERANCE, measure

    monkeypatch.setenv("TIERWISE_NVME_BLOCK_SIZE", "256KiB")  # read buffers within the budget
    config = "dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=36, " + (
        "num_attention_heads=4, num_key_value_heads=2)"
    )
    folder, nvme = tmp_path / "ckpt", tmp_path / "n"
    nvme.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(
        [sys.executable, "-c", SAVE_SCRIPT.replace("{config}", config), str(folder)],
        check=True,
        env=env,
        capture_output=True,
    )
    checkpoint = (folder / "model.safetensors").stat().st_size
    host_memory, device_memory = checkpoint // 2, 16 << 20
    bound = host_memory + device_memory + TOLERANCE
    assert checkpoint > bound  # holding the checkpoint whole would show
    script = LOAD_SCRIPT.replace("{config}", config)
    record = measure(script, argv=[str(folder), str(nvme), str(host_memory), str(device_memory)])
    mib = 1 << 20
    assert record["growth"] <= bound, (
        f"loading grew the peak RSS by {record['growth'] / mib:.1f} MiB; host_memory "
        f"{host_memory / mib:.1f} MiB + device_memory {device_memory / mib:.0f} MiB + "
        f"{TOLERANCE / mib:.0f} MiB tolerance; checkpoint {checkpoint / mib:.1f} MiB"
    )
