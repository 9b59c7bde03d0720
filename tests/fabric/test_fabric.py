"""Lightning Fabric's loop through ``TierwiseStrategy`` against the plain tierwise loop: the same
model built on the meta device, data and seed give bitwise the same losses and weights ([Note:
Fabric through tierwise]); a checkpoint saved through Fabric resumes bitwise."""

import pytest
import tierwise
import torch
from helpers.models import _config, tiny_batch
from lightning.fabric import Fabric
from tierwise.integrations.fabric import (
    TierwiseFabricError,
    TierwisePrecision,
    TierwiseStrategy,
)

# half the fp32 model data on the device: chunks move through the rCache
CONFIG = {"device_memory": 60_000, "chunk_size": 2048}
STEPS, ACCUM = 4, 2


def build():
    import transformers

    return transformers.AutoModelForCausalLM.from_config(_config("llama")).train()


def initial_weights():
    """The weights both loops start from, loaded after setup: a meta model's initial values
    come from the global RNG during setup, which tierwise_profiler (where installed) also draws
    from in its first, uncached probe."""
    torch.manual_seed(0)
    return build().state_dict()


def batches(step):
    return [tiny_batch(seed=10 * step + micro) for micro in range(ACCUM)]


def optimizer_and_schedule(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def plain_loop(precision, steps=STEPS, config=CONFIG):
    with torch.device("meta"):
        model = build()
    opt, schedule = optimizer_and_schedule(model)
    model, opt = tierwise.setup(model, opt, config, precision=precision, device="cpu")
    model.load_state_dict(initial_weights())
    losses = []
    for step in range(steps):
        for micro, batch in enumerate(batches(step)):
            sync = tierwise.no_sync(model) if micro < ACCUM - 1 else _nothing()
            with sync:
                loss = model(**batch).loss / ACCUM
                loss.backward()
            losses.append(loss.item())
        tierwise.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()
        schedule.step()
    return losses, model.state_dict()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def fabric_setup(precision_flag, strategy=None):
    """``strategy``: the strategy's registered name, or None for ``TierwiseStrategy(CONFIG)``."""
    if strategy is None:
        strategy = TierwiseStrategy(config=CONFIG)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision_flag)
    with fabric.init_module():
        model = build()
    assert all(p.is_meta for p in model.parameters())
    opt, schedule = optimizer_and_schedule(model)
    model, opt = fabric.setup(model, opt)
    model.load_state_dict(initial_weights())
    return fabric, model, opt, schedule


def fabric_steps(fabric, model, opt, schedule, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        for micro, batch in enumerate(batches(step)):
            with fabric.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loss = model(**batch).loss / ACCUM
                fabric.backward(loss)
            losses.append(loss.item())
        fabric.clip_gradients(model, opt, max_norm=0.5)
        opt.step()
        opt.zero_grad()
        schedule.step()
    return losses


def assert_same_state(ours, ref):
    assert ours.keys() == ref.keys()
    for name, value in ref.items():
        assert torch.equal(ours[name], value), name


@pytest.mark.parametrize("flag,precision", [("32-true", "fp32"), ("bf16-mixed", "bf16")])
def test_fabric_loop_matches_the_plain_tierwise_loop_bitwise(flag, precision):
    ref_losses, ref_state = plain_loop(precision)
    fabric, model, opt, schedule = fabric_setup(flag)
    assert isinstance(fabric.strategy.precision, TierwisePrecision)
    engine = tierwise.engine_of(model)
    assert engine.config.precision == precision
    losses = fabric_steps(fabric, model, opt, schedule, STEPS)
    assert engine.stats()["moved_bytes"].get("host->device", 0) > 0  # offload happened
    assert losses == ref_losses
    assert_same_state(model.state_dict(), ref_state)


def test_strategy_registered_by_name():
    fabric, model, opt, schedule = fabric_setup("32-true", strategy="tierwise")
    assert isinstance(fabric.strategy, TierwiseStrategy)
    assert (
        fabric_steps(fabric, model, opt, schedule, 1) == plain_loop("fp32", config={}, steps=1)[0]
    )


def test_fabric_save_and_load_resume_bitwise(tmp_path):
    fabric, model, opt, schedule = fabric_setup("32-true")
    fabric_steps(fabric, model, opt, schedule, 2)
    fabric.save(
        tmp_path / "ckpt", {"model": model, "optimizer": opt, "schedule": schedule, "step": 2}
    )
    assert (tmp_path / "ckpt").is_dir()  # tierwise's directory, written a chunk at a time
    whole = fabric_steps(fabric, model, opt, schedule, 2, first=2)
    end_state = model.state_dict()

    fabric, model, opt, schedule = fabric_setup("32-true")
    state = {"model": model, "optimizer": opt, "schedule": schedule, "step": 0}
    remainder = fabric.load(tmp_path / "ckpt", state)
    assert state["step"] == 2 and remainder == {}
    assert fabric_steps(fabric, model, opt, schedule, 2, first=2) == whole
    assert_same_state(model.state_dict(), end_state)


def test_what_tierwise_cannot_honour_is_refused_in_one_line():
    fabric, model, opt, schedule = fabric_setup("32-true")
    with pytest.raises(TierwiseFabricError, match="max_norm"):
        fabric.clip_gradients(model, opt, clip_val=1.0)
    with pytest.raises(TierwiseFabricError, match="norm_type"):
        fabric.clip_gradients(model, opt, max_norm=1.0, norm_type=1.0)
    with pytest.raises(TierwiseFabricError, match="together with its optimizer"):
        fabric.setup(build())
    with pytest.raises(TierwiseFabricError, match="no tierwise equivalent"):
        Fabric(accelerator="cpu", devices=1, strategy=TierwiseStrategy(), precision="64-true")
    with pytest.raises(TierwiseFabricError, match="make them agree"):
        Fabric(
            accelerator="cpu",
            devices=1,
            strategy=TierwiseStrategy(config={"precision": "fp16"}),
            precision="bf16-mixed",
        )
