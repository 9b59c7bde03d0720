"""Chunk tables and traces: packing keeps call order and never splits a parameter; the trace
follows the profiled order and treats checkpoint blocks as one operator in backward."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_search")

from helpers.models import tiny_model  # noqa: E402
from search_helpers import make_profile  # noqa: E402
from tierwise.chunks import first_use_order  # noqa: E402
from tierwise_search.hf_profile import profile_hf_config  # noqa: E402
from tierwise_search.layout import build_chunks, build_trace  # noqa: E402


@pytest.fixture(scope="module", params=["gpt2", "opt", "llama", "mixtral"])
def hf_profile(request):
    model = tiny_model(request.param)
    return profile_hf_config(model.config, batch=2, seq_len=16, checkpointing=True), model


@pytest.mark.parametrize("chunk_size", [1024, 2048, 5000, 10**6])
def test_packing_keeps_call_order_and_never_splits(hf_profile, chunk_size):
    profile, model = hf_profile
    table = build_chunks(profile, chunk_size)
    numel = {p.name: p.numel for p in profile.params}
    slots = [slot for specs in table.groups.values() for spec in specs for slot in spec.slots]
    assert [s.name for s in slots] == first_use_order(profile.forward_order, list(numel))
    for spec in (spec for specs in table.groups.values() for spec in specs):
        offset = 0
        for slot in spec.slots:  # contiguous, whole parameters, inside the chunk
            assert (slot.offset, slot.numel) == (offset, numel[slot.name])
            offset += slot.numel
        assert offset <= spec.capacity
        assert spec.capacity == max(chunk_size, offset)
    assert sum(table.used) == sum(p.numel() for p in model.parameters())


def test_profile_matches_the_real_model(hf_profile):
    profile, model = hf_profile
    real = dict(model.named_parameters())  # tied parameters once, under their first name
    assert {p.name: p.numel for p in profile.params} == {n: p.numel() for n, p in real.items()}
    assert set(profile.forward_order) == set(real)
    aliases = {a for p in profile.params for a in p.aliases}
    if model.config.tie_word_embeddings:
        assert aliases == {"lm_head.weight"}
        assert profile.multi_use  # the embedding is used first and last
    assert len(profile.checkpoint_blocks) == model.config.num_hidden_layers


def test_trace_follows_forward_then_backward_and_re_forward_holds_the_last_module():
    profile = make_profile([[1000, 1000], [1000, 1000], [1000, 1000]])
    table = build_chunks(profile, 2000)  # one block per chunk would be [0] [1] [2]
    plain = build_trace(profile, table, checkpointing=False)
    steps = [
        plain.chunk[plain.step_start[i] : plain.step_start[i + 1]].tolist()
        for i in range(plain.n_steps)
    ]
    assert steps == [[0], [0], [1], [1], [2], [2], [2], [2], [1], [1], [0], [0]]
    table = build_chunks(profile, 3000)  # blocks straddle chunks: [b0 b1.m0] [b1.m1 b2]
    coarse = build_trace(profile, table, checkpointing=True)
    steps = [
        coarse.chunk[coarse.step_start[i] : coarse.step_start[i + 1]].tolist()
        for i in range(coarse.n_steps)
    ]
    assert steps[:6] == [[0], [0], [0], [1], [1], [1]]  # forward, module by module
    # backward: a block's forward is re-run inside the backward of its last module, which stays
    # pinned meanwhile ([Note: the rCache minimum]): blk1's last module (chunk 1) joins its steps
    assert steps[6:] == [[1], [1], [1], [1, 0], [0], [0]]
    assert coarse.widest_step() == 2
