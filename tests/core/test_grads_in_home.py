"""[Note: gradients in the parameter payload]: 14 bytes of model data per parameter in bf16/fp16
with fp32 Adam states. Byte counts by hand for each placement; the engine allocates them and
peaks at them; a chunk whose gradients live in its parameter payload trains bitwise like one
with a gradient shard (accumulation, clipping, fp16 overflow, frozen parameters, several ranks).
[Note: no_sync buffers]: ``no_sync``'s whole-chunk sums are counted in the host tier and match
DDP's ``no_sync``."""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from helpers.multiproc import run_ranks
from tierwise.chunks.payload import PayloadSpec, model_data_by_tier
from tierwise.planning.totals import model_data_bytes, plan_model_bytes
from tierwise.tiers.base import TierBudgetError

N = 1000
COPIES = {"device": 1, "host": 1, "nvme": 2}.get  # NVMe keeps two copies of each state
INT8_MOMENT = 4 * (256 + 4)  # 1000 elements: 4 blocks of 256 one-byte codes + a fp32 scale each

# (precision, moments, home tier, optimizer tier, sharded) -> bytes per tier, by hand:
# params 2 (bf16/fp16) or 4, master 4, m and v 4 each; a gradient shard of 2 (or 4 in fp32) only
# where the gradients cannot go into the parameter payload
HAND = [
    ("bf16", "fp32", "host", "host", False, {"host": 2 * N + 12 * N}),
    ("fp16", "fp32", "host", "host", False, {"host": 14 * N}),
    ("bf16", "fp32", "host", "host", True, {"host": 14 * N}),
    ("bf16", "fp32", "host", "device", False, {"host": 2 * N, "device": 12 * N}),
    ("bf16", "fp32", "device", "device", True, {"device": 14 * N}),
    ("bf16", "fp32", "device", "host", True, {"device": 2 * N, "host": 12 * N}),
    # a device home the model computes in keeps a gradient shard ([Note: gradients without
    # copies] holds autograd's tensors; the shard takes them before a re-layout)
    ("bf16", "fp32", "device", "device", False, {"device": 2 * N + 12 * N + 2 * N}),
    ("bf16", "fp32", "device", "host", False, {"device": 2 * N, "host": 12 * N + 2 * N}),
    # NVMe: two copies of each state; the gradients in a host, NVMe or sharded device home
    # ([Note: gradients staged from a device home]), a gradient shard beside host states of an
    # NVMe home and beside NVMe states of a device home the model computes in
    ("bf16", "fp32", "nvme", "nvme", False, {"nvme": 2 * N + 2 * 12 * N}),
    ("bf16", "fp32", "host", "nvme", False, {"host": 2 * N, "nvme": 2 * 12 * N}),
    ("bf16", "fp32", "host", "nvme", True, {"host": 2 * N, "nvme": 2 * 12 * N}),
    ("bf16", "fp32", "nvme", "host", False, {"nvme": 2 * N, "host": 12 * N + 2 * N}),
    ("bf16", "fp32", "device", "nvme", True, {"device": 2 * N, "nvme": 2 * 12 * N}),
    ("bf16", "fp32", "device", "nvme", False, {"device": 2 * N, "nvme": 2 * 12 * N + 2 * N}),
    ("fp32", "fp32", "nvme", "nvme", False, {"nvme": 2 * 12 * N + 4 * N}),
    # fp32: the master is the parameter payload where they share a tier; gradients 4 bytes
    ("fp32", "fp32", "host", "host", False, {"host": 4 * N + 8 * N + 4 * N}),
    ("fp32", "fp32", "device", "host", False, {"device": 4 * N, "host": 12 * N + 4 * N}),
    # low-bit moments drop accordingly
    ("bf16", "bf16", "host", "host", False, {"host": 2 * N + 4 * N + 2 * 2 * N}),
    ("bf16", "int8", "host", "host", False, {"host": 2 * N + 4 * N + 2 * INT8_MOMENT}),
    (
        "bf16",
        "int8",
        "device",
        "device",
        False,
        {"device": 2 * N + 4 * N + 2 * INT8_MOMENT + 2 * N},
    ),
]


@pytest.mark.parametrize(("precision", "moments", "home", "optim", "sharded", "want"), HAND)
def test_model_data_by_tier_is_the_hand_count(precision, moments, home, optim, sharded, want):
    got = model_data_by_tier(
        [(N, True, sharded)],
        precision=precision,
        optimizer_states=moments,
        param_tier=home,
        optim_tier=optim,
        copies=COPIES,
    )
    assert got == want


def test_frozen_chunks_hold_only_their_parameters():
    for precision, nbytes in (("bf16", 2), ("fp16", 2), ("fp32", 4)):
        spec = PayloadSpec(precision=precision, trainable=False)
        sizes = spec.slab_sizes(N, home_tier="host", optim_tier="", copies=COPIES)
        assert sizes == [("host", nbytes * N)]


def test_totals_print_14_bytes_per_trainable_parameter():
    rows = dict(model_data_bytes(N, N, "bf16"))
    assert rows["parameters (bf16, gradients reuse them)"] == 2 * N
    assert rows["total"] == 14 * N
    assert dict(model_data_bytes(N, N, "fp16", "bf16"))["total"] == 10 * N
    assert dict(model_data_bytes(N, N, "fp32"))["total"] == 16 * N  # fp32 gradients of their own
    assert dict(model_data_bytes(N, N // 2, "bf16"))["total"] == 2 * N + 12 * (N // 2)  # frozen


def _meta_gpt2():
    import transformers as tf

    config = tf.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.0
    )
    config.embd_pdrop = config.attn_pdrop = 0.0
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(config)


def test_host_tier_peaks_at_14_bytes_per_chunk_element_after_clipped_steps():
    """A meta-built model, bf16, params and optimizer states in host memory, 2 clipped steps:
    the host tier's peak is the hand count, 14 bytes per element of every chunk's shard (no
    gradient shard). Per parameter it also counts the chunks' padding, which depends on the
    planner's packing: tests/search/test_bytes_per_param.py checks 14.5 B/param there."""
    model = _meta_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="bf16",
        device="cpu",
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=2,
    )
    engine = tierwise.engine_of(model)
    try:
        for step in range(2):
            model(**tiny_batch(seed=step, vocab=256)).loss.backward()
            tierwise.clip_grad_norm_(model, 0.5)
            opt.step()
            opt.zero_grad()
        chunks = list(engine.chunks())
        assert all(c.optim.grads_in_home and c.optim.grad is c.home for c in chunks)
        hand = sum(14 * c.shard_size for c in chunks)
        peak = engine.stats()["peak_bytes_by_tier"]["host"]
        assert peak == hand
        assert plan_model_bytes(engine.profile, engine.plan, "bf16")["host"] == hand
    finally:
        engine.close()


def _run(placement: str, *, precision="bf16", steps=3, accum=1, clip=None, overflow_at=None):
    model = tiny_model("gpt2")
    model.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        precision=precision,
        device="cpu",
        chunk_size=5000,
        param_placement=placement,
        optimizer_placement=placement,
        cache_blocks=2 if placement == "host" else "auto",
    )
    engine = tierwise.engine_of(model)
    losses = []
    try:
        for step in range(steps):
            for micro in range(accum):
                loss = model(**tiny_batch(seed=10 * step + micro)).loss / accum
                if step == overflow_at:
                    loss = loss * 1e10  # fp16 gradients overflow: the step is skipped
                loss.backward()
                losses.append(loss.item())
            if clip is not None:
                tierwise.clip_grad_norm_(model, clip)
            opt.step()
            opt.zero_grad()
        in_home = {c.optim.grads_in_home for c in engine.chunks() if c.optim is not None}
        return losses, {k: v.clone() for k, v in model.state_dict().items()}, in_home
    finally:
        engine.close()


@pytest.mark.parametrize(
    "schedule",
    [
        dict(accum=2, clip=0.05),
        dict(accum=3),
        dict(precision="fp16", overflow_at=1, clip=1.0),
    ],
    ids=["accumulation+clipping", "accumulation", "fp16-overflow"],
)
def test_gradients_in_the_home_train_bitwise_like_a_gradient_shard(schedule):
    """Host homes keep the gradients in the parameter payload (the next micro-batch's forward
    reads the parameters from the master); device homes have a gradient shard: bitwise equal."""
    want = _run("device", **schedule)
    got = _run("host", **schedule)
    assert want[2] == {False} and got[2] == {True}
    assert got[0] == want[0]
    for key, value in want[1].items():
        assert torch.equal(got[1][key], value), key


def test_a_skipped_step_leaves_the_parameters_bitwise():
    model = tiny_model("gpt2")
    model, opt = tierwise.setup(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        precision="fp16",
        device="cpu",
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=2,
        chunk_size=5000,
    )
    engine = tierwise.engine_of(model)
    try:
        homes = [c.home.tensor.clone() for c in engine.chunks()]
        (model(**tiny_batch()).loss * 1e10).backward()  # the homes now hold gradients
        assert any(
            not torch.equal(h, c.home.tensor) for h, c in zip(homes, engine.chunks(), strict=True)
        )
        opt.step()  # skipped
        assert engine.stats()["skipped_steps"] == 1
        opt.zero_grad()  # the parameters come back from the master
        for before, chunk in zip(homes, engine.chunks(), strict=True):
            assert torch.equal(before, chunk.home.tensor)
    finally:
        engine.close()


SETTINGS = {
    "zero3-host": dict(shard=True, cache_blocks=2, param_placement="host"),
    "zero3": dict(shard=True, cache_blocks=2, param_placement="device", prefetch=0),
    "ddp-like": dict(shard=False, param_placement="device"),
}


def _ranks_bf16(rank, world, settings):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="bf16",
        device="cpu",
        chunk_size=4096,
        optimizer_placement=settings["param_placement"],
        **settings,
    )
    engine = tierwise.engine_of(model)
    losses = []
    for step in range(3):
        for micro in range(3):  # no_sync on all micro-batches but the last
            loss = model(**tiny_batch(seed=100 * step + 10 * micro + rank)).loss / 3
            if micro < 2:
                with tierwise.no_sync(model):
                    loss.backward()
            else:
                loss.backward()
            losses.append(loss.item())
        tierwise.clip_grad_norm_(model, 0.05)
        opt.step()
        opt.zero_grad()
    in_home = {c.optim.grads_in_home for c in engine.chunks() if c.optim is not None}
    state = model.state_dict()  # a collective: every rank calls it
    engine.close()
    return losses, state, in_home


def _every_bf16_setting(rank, world):
    return {name: _ranks_bf16(rank, world, s) for name, s in SETTINGS.items()}


@pytest.mark.multiprocess
def test_two_ranks_with_gradients_in_the_home_are_bitwise_identical():
    per_rank = run_ranks(_every_bf16_setting, 2)
    for rank in range(2):
        results = per_rank[rank]
        assert results["zero3-host"][2] == {True} and results["ddp-like"][2] == {False}
        base_losses, base_state, _ = results["ddp-like"]
        for name, (losses, state, _) in results.items():
            assert losses == base_losses, name
            for key, value in base_state.items():
                assert torch.equal(state[key], value), (name, key)


def _no_sync_pair(rank, world, room):
    from tierwise.runtime.grads.reduce.local_sums import NoSyncSums

    # DDP's no_sync: 3 micro-batches accumulate locally, the 4th reduces
    torch.manual_seed(0)
    ref = tiny_model("gpt2")
    ddp = torch.nn.parallel.DistributedDataParallel(ref)
    for micro in range(4):  # DDP decides in forward whether backward reduces: both inside
        if micro < 3:
            with ddp.no_sync():
                (ddp(**tiny_batch(seed=10 * micro + rank)).loss / 4).backward()
        else:
            (ddp(**tiny_batch(seed=10 * micro + rank)).loss / 4).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters(remove_duplicate=False)}
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        chunk_size=4096,
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=3,
    )
    engine = tierwise.engine_of(model)
    host = engine.tiers["host"]
    at_rest = host.used_bytes
    sums_bytes = []
    for micro in range(4):
        loss = model(**tiny_batch(seed=10 * micro + rank)).loss / 4
        if micro < 3:
            with tierwise.no_sync(model):
                loss.backward()
            sums = engine.gradients.reducer.local_sums
            assert isinstance(sums, NoSyncSums)
            sums_bytes.append((sums.nbytes, host.used_bytes - at_rest))
        else:
            loss.backward()
    after = host.used_bytes - at_rest  # reduced: the sums are given back
    pairs = []  # (this rank's reduced gradients, DDP's averaged .grad) of each parameter piece
    for chunk in engine.chunks():
        shard = engine.grad_shard(chunk)
        start, end = chunk.shard_range()
        for slot in chunk.slots:
            lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
            if lo < hi:
                ref_piece = ref_grads[slot.name].reshape(-1)[lo - slot.offset : hi - slot.offset]
                pairs.append((slot.name, shard[lo - start : hi - start].clone(), ref_piece))
    whole = sum(c.capacity * 4 for c in engine.chunks() if c.trainable)
    peak_over = host.peak_bytes - at_rest
    # a host budget that holds the model but not the sums: no_sync fails and says what to do
    refused = None
    small = tiny_model("gpt2")
    small, _ = tierwise.setup(
        small,
        torch.optim.AdamW(small.parameters()),
        precision="fp32",
        device="cpu",
        chunk_size=4096,
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=3,
    )
    small_host = tierwise.engine_of(small).tiers["host"]
    small_host.budget = small_host.used_bytes + room
    try:
        with tierwise.no_sync(small):
            small(**tiny_batch(seed=rank)).loss.backward()
    except TierBudgetError as err:
        refused = str(err) + " ".join(getattr(err, "__notes__", []))
    tierwise.engine_of(small).close()
    engine.close()
    return sums_bytes, after, whole, peak_over, pairs, refused


@pytest.mark.multiprocess
def test_no_sync_sums_are_counted_in_the_host_tier_and_match_ddp():
    results = run_ranks(_no_sync_pair, 2, 1000)  # 1000 bytes of room: not one chunk's sum
    for sums_bytes, after, whole, peak_over, pairs, refused in results:
        for nbytes, counted in sums_bytes:
            assert nbytes == counted == whole  # every chunk's whole (unsharded) sum, counted
        assert after == 0
        assert peak_over >= whole
        assert pairs
        for name, got, want in pairs:  # DDP's no_sync sum, up to summation order
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-8), name
        assert refused is not None and "Config.accumulation_steps" in refused
