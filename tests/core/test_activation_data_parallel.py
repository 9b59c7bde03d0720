"""Activation policies on 2 gloo ranks (sharded): host swaps and recompute train like keep."""

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from helpers.multiproc import run_ranks

pytestmark = pytest.mark.multiprocess
STEPS = 4
POLICIES = {
    "keep": dict(),
    "host": dict(activation_offload="host"),
    "recompute": dict(activation_checkpointing=True),
    "mixed": dict(activation_policy={"transformer.h.0": "host", "transformer.h.1": "recompute"}),
}


def _train_every_policy(rank, world):
    out = {}
    for name, policy in POLICIES.items():
        model = tiny_model("gpt2")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        model, opt = tierwise.setup(
            model,
            opt,
            precision="fp32",
            device="cpu",
            chunk_size=4096,
            shard=True,
            cache_blocks=6,
            param_placement="host",
            **policy,
        )
        losses = []
        for step in range(STEPS):
            loss = model(**tiny_batch(seed=1000 * step + rank)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        state = model.state_dict()  # a collective: every rank calls it
        stats = tierwise.engine_of(model).stats()["activations"]
        tierwise.engine_of(model).close()
        out[name] = (losses, state, stats)
    return out


def test_host_and_recompute_train_like_keep_on_two_sharded_ranks():
    ranks = run_ranks(_train_every_policy, 2)
    for rank, runs in enumerate(ranks):
        base_losses, base_state, _ = runs["keep"]
        for name, (losses, state, _) in runs.items():
            assert losses == base_losses, (rank, name)
            assert state.keys() == base_state.keys()
            assert all(torch.equal(state[k], base_state[k]) for k in state), (rank, name)
        assert runs["host"][2]["swapped_out_bytes"]["host"] > 0
        assert runs["host"][2]["swapped_in_bytes"] == runs["host"][2]["swapped_out_bytes"]
        assert runs["recompute"][2]["recomputed_blocks"] == 2
        assert runs["mixed"][2]["policy"] == {"host": 1, "recompute": 1}
    # the ranks trained on different batches: the gradients were reduced, the parameters agree
    assert ranks[0]["host"][0] != ranks[1]["host"][0]
    first, second = ranks[0]["host"][1], ranks[1]["host"][1]
    assert all(torch.equal(first[k], second[k]) for k in first)
