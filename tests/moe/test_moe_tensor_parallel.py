"""Tensor parallelism (Megatron column/row linears) against single-process PyTorch (no engine)."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_moe")
pytest.importorskip("transformers")

import moe_workers as w  # noqa: E402
from helpers.models import tiny_model  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402

TOLERANCE = 1e-5


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4], ids=["tp2", "tp2xdp2"])
def test_llama_tensor_parallel_matches_single_process(world):
    ref = w.reference_run("llama", moe=False)

    ranks = run_ranks(w.parallel_run, world, "llama", "tensor", 2)

    for result in ranks:
        for got, want in zip(result["losses"], ref["losses"], strict=True):
            assert abs(got - want) <= TOLERANCE * abs(want)
        for name, want in ref["first_grads"].items():
            assert w.max_relative_error(result["first_grads"][name], want) <= TOLERANCE, name
        for name, want in ref["state"].items():
            assert result["state"][name].shape == tuple(want.shape), name
            assert w.max_relative_error(result["state"][name], want) <= TOLERANCE, name
        assert result["reload_matches"]
    # attention and MLP weights are halved on every rank; embeddings, norms, lm_head are whole
    model = w.build_model("llama")
    split = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    full = sum(p.numel() for p in model.parameters())
    assert all(r["param_numel"] == full - split // 2 for r in ranks)
    expected_dp = {2: [[0], [1]], 4: [[0, 2], [1, 3], [0, 2], [1, 3]]}[world]
    assert [r["dp_ranks"] for r in ranks] == expected_dp


@pytest.mark.multiprocess
def test_heads_not_divisible_is_a_clear_error():
    messages = run_ranks(w.mesh_error_run, 2, "llama", "tensor", 2, {"num_key_value_heads": 1})

    assert all(
        "tensor parallel size 2 does not divide num_key_value_heads=1 of model.layers.0.self_attn"
        in message
        for message in messages
    )


def test_claims_attention_and_mlp_projections():
    from tierwise.config import Config
    from tierwise_moe import ColumnParallelLinear, RowParallelLinear, TensorParallel

    model = tiny_model("llama")
    pattern = TensorParallel(size=1, config=Config(device="cpu"), process_group=None)
    pattern.prepare(model)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, ColumnParallelLinear)
    assert isinstance(layer.self_attn.o_proj, RowParallelLinear)
    assert isinstance(layer.mlp.up_proj, ColumnParallelLinear)
    assert isinstance(layer.mlp.down_proj, RowParallelLinear)
    claimed = {n for n, p in model.named_parameters() if pattern.claims(n, p)}
    assert claimed == {n for n, _ in model.named_parameters() if n.endswith("proj.weight")}
    with pytest.raises(ValueError, match="no Llama-style attention"):
        TensorParallel(size=1, config=Config(device="cpu"), process_group=None).prepare(
            tiny_model("gpt2")
        )
