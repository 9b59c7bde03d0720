"""Config.optimizer_states ([Note: low-bit optimizer states]): Adam moments stored in bf16 or
in torchao AdamW8bit's int8 scheme, checked against torchao itself and against PyTorch's fused
AdamW with its moments rounded the same way between steps."""

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from tierwise.checkpoint.reader import CheckpointReader
from tierwise.optim.state_formats import (
    MomentFormat,
    dequantize_blocks,
    dynamic_map,
    quantize_blocks,
)


def _torchao(module: str = "quant_utils"):
    """torchao's ``optim.<module>`` (the test extra installs torchao: the reference here)."""
    return pytest.importorskip(f"torchao.optim.{module}")


WIDTH = 64  # 64 x 64 weights: 4096 elements, 16 whole blocks (torchao quantizes them too)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH, bias=False),
        torch.nn.Tanh(),
        torch.nn.Linear(WIDTH, WIDTH, bias=False),
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, WIDTH, generator=gen), torch.randn(16, WIDTH, generator=gen)


def _loss(model, step: int) -> torch.Tensor:
    x, y = _batch(step)
    return (model(x) - y).pow(2).mean()


def _tierwise(optimizer_states: str, **overrides):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    config = dict(
        precision="fp32",
        device="cpu",
        param_placement="host",
        optimizer_placement="host",
        chunk_size=2 * WIDTH * WIDTH,
        optimizer_states=optimizer_states,
    )
    config.update(overrides)
    return tierwise.setup(model, opt, **config)


def _train(model, opt, steps: int, clip: float | None = None) -> list[float]:
    losses = []
    for step in range(steps):
        loss = _loss(model, step)
        loss.backward()
        if clip is not None:
            tierwise.clip_grad_norm_(model, clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _torchao_round(state: torch.Tensor, signed: bool) -> None:
    """``state`` replaced by its int8 encoding's values, with torchao's own functions."""
    quant_utils = _torchao()
    qmap = torch.tensor(quant_utils.create_dynamic_map(signed=signed), dtype=torch.float32)
    scaled, scale = quant_utils.scale_tensor(state.view(-1), 256)
    codes = quant_utils.quantize_8bit_with_qmap(scaled, qmap)
    state.copy_(quant_utils.dequant_with_qmap(codes, qmap, scale).view(state.shape))


def _rounded_reference(optimizer_states: str, steps: int, clip: float | None = None):
    """PyTorch's fused AdamW with exp_avg / exp_avg_sq rounded to the stored precision after
    every step (bf16: round to nearest; int8: torchao's block quantization)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    losses = []
    for step in range(steps):
        loss = _loss(model, step)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        for state in opt.state.values():
            for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                if optimizer_states == "bf16":
                    state[key].copy_(state[key].bfloat16().float())
                else:
                    _torchao_round(state[key], signed)
    return losses, model


def _moments(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each parameter's decoded (exp_avg, exp_avg_sq) from its chunk (one process)."""
    engine = tierwise.engine_of(model)
    fmts = engine.optimizer.moments.formats
    out = {}
    for chunk in engine.chunks():
        stored = [chunk.optim.exp_avg.tensor, chunk.optim.exp_avg_sq.tensor]
        values = [f.decoded(s, chunk.shard_size) for f, s in zip(fmts, stored, strict=True)]
        for slot in chunk.slots:
            part = slice(slot.offset, slot.offset + slot.numel)
            out[slot.name] = tuple(v[part].view(slot.shape) for v in values)
    return out


@pytest.mark.parametrize("signed", [True, False])
def test_int8_encoding_is_torchaos_bit_for_bit(signed):
    quant_utils = _torchao()
    qmap = torch.tensor(quant_utils.create_dynamic_map(signed=signed), dtype=torch.float32)
    assert torch.equal(dynamic_map(signed), qmap)
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(1 << 16, generator=gen) * torch.logspace(-9, 1, 1 << 16)
    values = values[torch.randperm(values.numel(), generator=gen)]
    # the values where rounding turns: map entries, midpoints and their fp32 neighbours
    mids = (qmap[1:] + qmap[:-1]) / 2
    edges = torch.cat(
        [qmap, mids, torch.nextafter(mids, qmap[1:]), torch.nextafter(mids, qmap[:-1])]
    )
    edges = torch.cat([edges, torch.zeros(-edges.numel() % 255)]).view(-1, 255)
    edges = torch.cat([edges, torch.ones(edges.shape[0], 1)], dim=1).view(-1)  # scale 1
    values = torch.cat([values, edges, torch.zeros(256)])
    if not signed:
        values = values.abs()
    codes = torch.empty(values.numel(), dtype=torch.uint8)
    scales = torch.empty(values.numel() // 256)
    quantize_blocks(values, codes, scales, signed=signed)
    scaled, ref_scales = quant_utils.scale_tensor(values, 256)
    ref_codes = quant_utils.quantize_8bit_with_qmap(scaled, qmap)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(scales, ref_scales)
    out = torch.empty_like(values)
    dequantize_blocks(codes, scales, out, signed=signed)
    assert torch.equal(out, quant_utils.dequant_with_qmap(ref_codes, qmap, ref_scales))


def test_moment_format_sizes_and_round_trip():
    fmt = MomentFormat("int8", signed=True)
    assert fmt.stored_numel(1000) == 1024 + 4 * 4  # padded to whole blocks, one fp32 scale each
    values = torch.randn(1000)
    stored = fmt.encoded(values)
    assert stored.dtype == torch.uint8 and stored.numel() == 1040
    decoded = fmt.decoded(stored, 1000)
    assert (decoded - values).abs().max() <= values.abs().max() * 0.02
    assert MomentFormat("bf16", signed=False).stored_numel(1000) == 1000


@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("optimizer_states", ["bf16", "int8"])
def test_matches_fused_adamw_with_moments_rounded(optimizer_states, clip):
    """Same kernel, same rounding of the moments between steps: bitwise the same (with
    clipping too)."""
    ref_losses, ref_model = _rounded_reference(optimizer_states, 4, clip)
    model, opt = _tierwise(optimizer_states)
    losses = _train(model, opt, 4, clip)
    assert losses == ref_losses
    state = model.state_dict()
    for name, value in ref_model.state_dict().items():
        assert torch.equal(state[name], value), name


def test_int8_step_matches_torchao_adamw8bit():
    """Two steps of tierwise int8 against torchao's AdamW8bit (run on CPU through
    torch.compile) on the same parameters and gradients. The blocks and maps are the same
    (4096-element weights: torchao quantizes them); the update is torch's fused kernel here
    and torchao's compiled formula there. They round differently: torchao takes the bias
    corrections 1 - beta^t in fp32 (1 - 0.999 is then 1.3e-5 off), so the parameters agree to
    1e-4 of the steps' total update (lr x steps), and a moment differs by at most one code,
    where a value sits on a rounding boundary (at least 99% of the codes are equal)."""
    AdamW8bit = _torchao("adam").AdamW8bit  # noqa: N806 - torchao's class

    steps = 2
    model, opt = _tierwise("int8")
    _train(model, opt, steps)
    ref = _model()
    ref_opt = AdamW8bit(ref.parameters(), lr=1e-2, weight_decay=0.01)
    _train(ref, ref_opt, steps)

    state = model.state_dict()
    moments = _moments(model)
    engine = tierwise.engine_of(model)
    fmts = engine.optimizer.moments.formats
    (chunk,) = engine.chunks()
    slabs = (chunk.optim.exp_avg, chunk.optim.exp_avg_sq)
    offsets = {s.name: (s.offset, s.offset + s.numel) for s in chunk.slots}
    for name, param in ref.named_parameters():
        assert (state[name] - param.detach()).abs().max() <= 1e-4 * 1e-2 * steps, name
        ref_state = ref_opt.state[param]
        for ours, key in zip(moments[name], ("exp_avg", "exp_avg_sq"), strict=True):
            theirs = ref_state[key].dequantize()
            blocks = theirs.reshape(-1, 256).abs().amax(-1, keepdim=True)
            diff = (ours.reshape(-1, 256) - theirs.reshape(-1, 256)).abs()
            assert (diff <= blocks * 0.015 + 1e-30).all(), (name, key)  # one code step
        for fmt, slab, key in zip(fmts, slabs, ("exp_avg", "exp_avg_sq"), strict=True):
            codes, scales = fmt.split(slab.tensor)
            lo, hi = offsets[name]
            same = (codes[lo:hi] == ref_state[key].codes.view(-1)).float().mean()
            assert same >= 0.99, (name, key, float(same))
            ours = scales[lo // 256 : hi // 256]
            assert torch.allclose(ours, ref_state[key].scale, rtol=1e-4, atol=0), (name, key)


def test_int8_unused_parameter_keeps_its_moments():
    """[Note: unused parameters are skipped]: a parameter without a gradient keeps its master
    and its stored moments bit for bit (its blocks are its own: 4096 elements)."""
    model, opt = _tierwise("int8")
    _train(model, opt, 2)
    engine = tierwise.engine_of(model)
    chunk = next(iter(engine.chunks()))
    before = [s.tensor.clone() for s in (chunk.optim.exp_avg, chunk.optim.exp_avg_sq)]
    master = chunk.optim.master.tensor.clone()
    first = model[0].weight
    model[0].weight.requires_grad_(False)  # no gradient for the first weight this step
    x, y = _batch(5)
    (model(x) - y).pow(2).mean().backward()
    first.requires_grad_(True)
    opt.step()
    opt.zero_grad()
    slot = next(s for s in chunk.slots if s.param is first)
    part = slice(slot.offset, slot.offset + slot.numel)
    assert torch.equal(chunk.optim.master.tensor[part], master[part])
    assert not torch.equal(chunk.optim.master.tensor, master)  # the other weight moved
    fmt = engine.optimizer.moments.formats[0]
    blocks = slice(slot.offset // 256, (slot.offset + slot.numel) // 256)
    for old, slab in zip(before, (chunk.optim.exp_avg, chunk.optim.exp_avg_sq), strict=True):
        codes, scales = fmt.split(slab.tensor)
        old_codes, old_scales = fmt.split(old)
        assert torch.equal(codes[part], old_codes[part])
        assert torch.equal(scales[blocks], old_scales[blocks])


def _memorise(optimizer_states: str, steps: int) -> tuple[list[float], torch.nn.Module]:
    """A tiny GPT-2 trained on four batches in turn (it can memorise them: the loss falls)."""
    torch.manual_seed(0)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model, opt = tierwise.setup(
        model, opt, precision="bf16", device="cpu", optimizer_states=optimizer_states
    )
    losses = []
    for step in range(steps):
        loss = model(**tiny_batch(seed=step % 4)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("optimizer_states", ["bf16", "int8"])
def test_training_quality_close_to_fp32_states(optimizer_states):
    """A loose check (the bench measures 200 steps of ``tierwise train``): 40 steps of a tiny
    GPT-2 end within 5% of the fp32-state run's loss (mean of the last 4 steps)."""
    steps = 40
    fp32, _ = _memorise("fp32", steps)
    low, model = _memorise(optimizer_states, steps)
    ref, ours = sum(fp32[-4:]) / 4, sum(low[-4:]) / 4
    assert ref < 0.7 * sum(fp32[:4]) / 4  # the run learns
    assert abs(ours - ref) <= 0.05 * ref, (ours, ref)
    kinds = {c.optim.exp_avg.kind.value for c in tierwise.engine_of(model).chunks() if c.optim}
    assert kinds == {"lowbit_state"}


def test_host_tier_holds_fewer_bytes():
    used = {}
    for states in ("fp32", "bf16", "int8"):
        model = tiny_model("gpt2")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = tierwise.setup(
            model,
            opt,
            precision="bf16",
            device="cpu",
            param_placement="host",
            optimizer_placement="host",
            optimizer_states=states,
        )
        engine = tierwise.engine_of(model)
        used[states] = {
            k: sum(
                s.nbytes
                for c in engine.chunks()
                if c.optim is not None
                for s in (c.optim.exp_avg, c.optim.exp_avg_sq)
                if s.tier.name == "host"
            )
            for k in ("moments",)
        }["moments"]
        model(**tiny_batch(seed=0)).loss.backward()  # it trains
        opt.step()
    elements = used["fp32"] // 8
    assert used["bf16"] == elements * 4
    assert elements * 2 <= used["int8"] <= elements * 2 * (1 + 4 / 256) + 2 * 256 * 8


def test_config_rejects_unknown_state_precision():
    with pytest.raises(tierwise.ConfigError, match="optimizer_states.*fp32, bf16, int8"):
        tierwise.Config(optimizer_states="int4")


@pytest.mark.parametrize("optimizer_states", ["bf16", "int8"])
def test_checkpoint_resume_continues_bitwise(tmp_path, optimizer_states):
    """Invariant 5 with low-bit moments: they are saved as they are and restored bit for bit."""
    model, opt = _tierwise(optimizer_states)
    _train(model, opt, 3)
    tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
    straight = []
    for step in range(3, 6):
        loss = _loss(model, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        straight.append(loss.item())
    resumed_model, resumed_opt = _tierwise(optimizer_states)
    tierwise.load_checkpoint(tmp_path / "ckpt", resumed_model, resumed_opt)
    resumed = []
    for step in range(3, 6):
        loss = _loss(resumed_model, step)
        loss.backward()
        resumed_opt.step()
        resumed_opt.zero_grad()
        resumed.append(loss.item())
    assert resumed == straight
    for name, value in model.state_dict().items():
        assert torch.equal(resumed_model.state_dict()[name], value), name


def test_checkpoint_stores_int8_moments_as_they_are(tmp_path):
    sizes = {}
    for states in ("fp32", "int8"):
        model, opt = _tierwise(states)
        _train(model, opt, 2)
        tierwise.save_checkpoint(tmp_path / states, model, opt)
        sizes[states] = sum(f.stat().st_size for f in (tmp_path / states).glob("rank*.safetensors"))
    # master 4 B + moments 2 x (1 B + 4 B per 256) per element, against 12 B
    assert sizes["int8"] < 0.55 * sizes["fp32"]


@pytest.mark.parametrize(
    ("saved", "loaded"), [("int8", "fp32"), ("fp32", "int8"), ("int8", "bf16")]
)
def test_checkpoint_converts_state_precision(tmp_path, saved, loaded):
    """A checkpoint of one state precision loads into another: int8 moments dequantised into
    fp32 (exactly the values the int8 run decoded), fp32 ones quantised into int8; the run
    goes on."""
    model, opt = _tierwise(saved)
    _train(model, opt, 3)
    tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
    saved_moments = _moments(model)
    other, other_opt = _tierwise(loaded)
    tierwise.load_checkpoint(tmp_path / "ckpt", other, other_opt)
    loaded_moments = _moments(other)
    fmts = tierwise.engine_of(other).optimizer.moments.formats
    for name, pair in saved_moments.items():
        assert torch.equal(other.state_dict()[name], model.state_dict()[name])
        for fmt, ours, theirs in zip(fmts, loaded_moments[name], pair, strict=True):
            expected = fmt.decoded(fmt.encoded(theirs.reshape(-1)), theirs.numel())
            assert torch.equal(ours.reshape(-1), expected), name
    losses = _train(other, other_opt, 2)
    assert all(loss == loss for loss in losses)  # finite, it trains


DP_STEPS = 4


def _dp_setup():
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        chunk_size=4096,
        shard=True,
        param_placement="host",
        optimizer_placement="host",
        optimizer_states="int8",
    )


def _dp_int8(rank, world, save_to=None):
    """int8 states over ``world`` ranks (sharded chunks: each rank quantizes its own shard in
    256-element blocks, which start where the one-process blocks start), each rank on its own
    half of a global batch; returns losses and the full parameters (a collective)."""
    model, opt = _dp_setup()
    engine = tierwise.engine_of(model)
    assert all(c.shard_size % 256 == 0 for c in engine.chunks())
    losses = []
    for step in range(DP_STEPS):
        parts = range(rank, 2, world)  # one process takes both halves, as accumulation
        total = 0.0
        for part in parts:
            loss = model(**tiny_batch(seed=1000 * step + part)).loss / len(parts)
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    if save_to is not None:
        tierwise.save_checkpoint(save_to, model, opt)
    return losses, model.state_dict()


@pytest.mark.multiprocess
def test_int8_data_parallel_matches_one_process(tmp_path):
    """Two gloo ranks with int8 states (each quantizing its own shard) train bitwise like one
    process accumulating both halves of the global batch: the reduced gradient (g0 + g1) / 2
    equals g0 / 2 + g1 / 2 exactly (halving is exact), and the blocks are the same."""
    from helpers.multiproc import run_ranks

    ranks = run_ranks(_dp_int8, 2, tmp_path / "ckpt")
    # the ranks compute on one thread (helpers.multiproc); so does the reference, since a
    # matmul's reduction order (and so its last bit) depends on the thread count
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_losses, one_state = _dp_int8(0, 1)
    finally:
        torch.set_num_threads(threads)
    global_losses = [(a + b) / 2 for a, b in zip(ranks[0][0], ranks[1][0], strict=True)]
    assert global_losses == one_losses
    for name, value in one_state.items():
        for rank_state in (ranks[0][1], ranks[1][1]):
            assert torch.equal(rank_state[name], value), name
    # resharding: the 2-rank checkpoint loads into one process; the int8 blocks are encoded
    # again from the saved values (the checkpoint reader decodes them)
    model, opt = _dp_setup()
    tierwise.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ranks[0][1].items())
    reader = CheckpointReader(tmp_path / "ckpt")
    engine = tierwise.engine_of(model)
    for chunk in engine.chunks():
        for fmt, kind, slab in zip(
            engine.optimizer.moments.formats,
            ("exp_avg", "exp_avg_sq"),
            (chunk.optim.exp_avg, chunk.optim.exp_avg_sq),
            strict=True,
        ):
            values = torch.zeros(chunk.shard_size)
            for slot in chunk.slots:
                values[slot.offset : slot.offset + slot.numel] = reader.read(slot.name, kind)
            expected = fmt.decoded(fmt.encoded(values), chunk.shard_size)
            assert torch.equal(fmt.decoded(slab.tensor, chunk.shard_size), expected)


@pytest.mark.parametrize("optimizer_states", ["bf16", "int8"])
def test_speculative_host_updates_with_lowbit_states_are_exact(optimizer_states):
    """[Note: speculative updates] with low-bit moments in host memory: in-backward updates,
    kept or rolled back (clipping on some steps), give bitwise the after-backward result (the
    undo copy holds the stored bytes)."""
    from helpers.overlap import CLIPS, assert_bitwise, loop

    def run(overlap):
        model = tiny_model("gpt2")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        model, opt = tierwise.setup(
            model,
            opt,
            precision="bf16",
            device="cpu",
            chunk_size=5000,
            param_placement="host",
            optimizer_placement="host",
            optimizer_overlap=overlap,
            optimizer_states=optimizer_states,
        )
        losses, modes, _ = loop(model, opt, clips=CLIPS["some"])
        return losses, modes, {k: v.clone() for k, v in model.state_dict().items()}

    want, got = run("after-backward"), run("in-backward")
    assert_bitwise(got, want, optimizer_states)
    assert got[1] == ["speculative-kept", "rolled-back", "speculative-kept", "rolled-back"]
