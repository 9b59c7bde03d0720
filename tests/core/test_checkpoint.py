"""Invariant 5: a checkpoint resumed mid-run continues bitwise identically; state dicts are
full tensors under the original names."""

import shutil

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from helpers.train import train
from tierwise.checkpoint.manifest import CheckpointError
from tierwise.checkpoint.reader import CheckpointReader

PLANS = {
    "device": dict(precision="bf16", device="cpu"),
    "host": dict(
        precision="fp32",
        device="cpu",
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=3,
    ),
    "fp16": dict(precision="fp16", device="cpu", param_placement="host", cache_blocks=3),
}


def build(kind, plan):
    model = tiny_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return tierwise.setup(model, opt, **PLANS[plan])


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_resume_continues_bitwise(tmp_path, plan):
    model, opt = build("gpt2", plan)
    train(model, opt, 5)
    tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
    straight = train(model, opt, 5, first_seed=5)
    final = model.state_dict()

    resumed, resumed_opt = build("gpt2", plan)
    tierwise.load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt)
    assert train(resumed, resumed_opt, 5, first_seed=5) == straight
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, final[key]), key


def test_state_dict_loads_into_a_fresh_hf_model_with_identical_outputs():
    model, opt = build("llama", "host")
    train(model, opt, 3)
    state = model.state_dict()
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    fresh = tiny_model("llama", seed=123)
    fresh.load_state_dict(state)
    data = tiny_batch(seed=42)
    model.eval()
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(model(**data).logits, fresh(**data).logits)


def test_load_state_dict_into_a_managed_model():
    source = tiny_model("gpt2", seed=7)
    model, _ = build("gpt2", "host")
    model.load_state_dict(source.state_dict())
    model.eval()
    source.eval()
    with torch.no_grad():
        data = tiny_batch(seed=3)
        assert torch.equal(model(**data).logits, source(**data).logits)
    assert "lm_head.weight" in model.state_dict()  # tied names are all present


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = build("gpt2", "host")
    train(model, opt, 2)
    tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
    saved = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    train(model, opt, 1, first_seed=2)

    def boom(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError, match="disk gone"):
        tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == saved
    shutil.rmtree(tmp_path / "ckpt.tmp", ignore_errors=True)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    model, opt = build("llama", "host")
    tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
    other, other_opt = build("gpt2", "host")
    with pytest.raises(CheckpointError, match="has no transformer"):
        tierwise.load_checkpoint(tmp_path / "ckpt", other, other_opt)


def test_reader_gives_each_parameter_by_name(tmp_path):
    model, opt = build("gpt2", "host")
    train(model, opt, 2)
    tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
    state = model.state_dict()
    reader = CheckpointReader(tmp_path / "ckpt")
    assert reader.world_size == 1 and reader.steps_taken == 2
    assert reader.aliases() == {"lm_head.weight": "transformer.wte.weight"}
    for name in [*reader.names(), "lm_head.weight"]:
        assert torch.equal(reader.tensor(name), state[name]), name
        assert torch.equal(
            reader.read(name, "exp_avg_sq", 1, 3),
            reader.tensor(name, "exp_avg_sq").reshape(-1)[1:3],
        )
        assert reader.step(name) == 2.0


def _save_then_die(path):
    import os
    import signal

    import tierwise.checkpoint.directory as ckpt

    model, opt = build("gpt2", "host")
    train(model, opt, 2)
    tierwise.save_checkpoint(path, model, opt)
    train(model, opt, 1, first_seed=2)
    real = ckpt.describe

    def killed_after_first_file(file):
        real(file)
        os.kill(os.getpid(), signal.SIGKILL)

    ckpt.describe = killed_after_first_file
    tierwise.save_checkpoint(path, model, opt)


def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    import multiprocessing

    process = multiprocessing.get_context("spawn").Process(
        target=_save_then_die, args=(tmp_path / "ckpt",)
    )
    process.start()
    process.join(timeout=300)
    assert process.exitcode == -9
    assert (tmp_path / "ckpt.tmp").is_dir()  # the killed save's files
    model, opt = build("gpt2", "host")
    train(model, opt, 2)
    resumed, resumed_opt = build("gpt2", "host")
    tierwise.load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt)
    assert train(resumed, resumed_opt, 2, first_seed=2) == train(model, opt, 2, first_seed=2)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate", "has .* bytes, the manifest says"),
        ("flip", "does not match its checksum"),
        ("no-manifest", "incomplete: it has no manifest.json"),
        ("missing", "incomplete: engine.pt is missing"),
    ],
)
def test_damaged_checkpoint_is_refused_in_one_line(tmp_path, damage, message):
    model, opt = build("gpt2", "host")
    train(model, opt, 1)
    path = tmp_path / "ckpt"
    tierwise.save_checkpoint(path, model, opt)
    rank_file = path / "rank00000-of-00001.safetensors"
    if damage == "truncate":
        rank_file.write_bytes(rank_file.read_bytes()[:-100])
    elif damage == "flip":
        data = bytearray(rank_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        rank_file.write_bytes(bytes(data))
    elif damage == "no-manifest":
        (path / "manifest.json").unlink()
    else:
        (path / "engine.pt").unlink()
    fresh, fresh_opt = build("gpt2", "host")
    before = fresh.state_dict()
    with pytest.raises(CheckpointError, match=message) as err:
        tierwise.load_checkpoint(path, fresh, fresh_opt)
    assert "\n" not in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())  # nothing written


def test_manifest_lists_every_file_with_its_size_and_checksum(tmp_path):
    """The manifest ([Note: checkpoint manifest]): every file of the directory with its size and
    SHA-256 (computed here with hashlib), the world size, the step and the tierwise version."""
    import hashlib
    import json

    from tierwise._version import __version__

    model, opt = build("gpt2", "host")
    train(model, opt, 3)
    path = tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
    manifest = json.loads((path / "manifest.json").read_text())
    on_disk = sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == on_disk
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert (manifest["world_size"], manifest["step"]) == (1, 3)
    assert manifest["tierwise_version"] == __version__


class _RunsCode:
    """Unpickling it creates ``marker``: what a checkpoint from someone else could run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("file", ["engine.pt", "extra-rank00000.pt"])
def test_a_checkpoint_holding_code_is_refused_in_one_line(tmp_path, file):
    """[Note: checkpoints hold plain data]: a file that unpickles into a call is refused before
    anything runs, although the manifest vouches for it (whoever wrote the file wrote that too)."""
    import hashlib
    import json

    model, opt = build("gpt2", "host")
    train(model, opt, 1)
    path = tmp_path / "ckpt"
    tierwise.save_checkpoint(path, model, opt, extra={"step": 1})
    marker = tmp_path / "code-ran"
    torch.save({"step": 1, "payload": _RunsCode(marker)}, path / file)
    manifest = json.loads((path / "manifest.json").read_text())
    data = (path / file).read_bytes()
    manifest["files"][file] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))

    fresh, fresh_opt = build("gpt2", "host")
    before = fresh.state_dict()
    with pytest.raises(CheckpointError, match=f"{file} holds something other than plain data"):
        tierwise.load_checkpoint(path, fresh, fresh_opt)
    with pytest.raises(CheckpointError) as err:
        reader = CheckpointReader(path)
        reader.engine_state() if file == "engine.pt" else reader.extra(0)
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    assert not marker.exists()
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())  # nothing written


def test_extra_that_is_not_plain_data_is_refused_when_saving(tmp_path):
    from fractions import Fraction

    model, opt = build("gpt2", "host")
    train(model, opt, 1)
    path = tmp_path / "ckpt"
    extra = {"step": 1, "rng": {"cpu": torch.get_rng_state(), "seeds": (1, Fraction(1, 3))}}
    with pytest.raises(
        CheckpointError, match=r"extra\['rng'\]\['seeds'\]\[1\] is a fractions.Fraction"
    ) as err:
        tierwise.save_checkpoint(path, model, opt, extra=extra)
    assert "\n" not in str(err.value)
    assert not path.exists() and not path.with_name("ckpt.tmp").exists()
    extra["rng"]["seeds"] = (1, 3)  # plain data comes back as it went in
    tierwise.save_checkpoint(path, model, opt, extra=extra)
    fresh, fresh_opt = build("gpt2", "host")
    back = tierwise.load_checkpoint(path, fresh, fresh_opt)
    assert back["step"] == 1 and back["rng"]["seeds"] == (1, 3)
    assert torch.equal(back["rng"]["cpu"], extra["rng"]["cpu"])


def test_a_save_s_pieces_are_counted_one_at_a_time_in_the_ledger(tmp_path):
    """[Note: the memory ledger]: save_checkpoint copies each parameter's piece of each stored
    kind (fp32 here: the parameter and Adam's two moments) into host memory counted in the
    ``checkpoint_pieces`` pool, one at a time: its peak is the largest parameter's fp32 bytes,
    nothing is held after the save, and the checkpoint still resumes bitwise."""
    largest = 4 * max(p.numel() for p in tiny_model("gpt2").parameters())
    model, opt = build("gpt2", "host")
    train(model, opt, 2)
    engine = tierwise.engine_of(model)
    assert engine.stats()["memory"]["checkpoint_pieces"]["peak_bytes"] == 0
    tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
    entry = engine.stats()["memory"]["checkpoint_pieces"]
    assert entry["peak_bytes"] == largest and entry["bytes"] == 0
    assert entry["memory"] == "host" and entry["within"] is None
    straight = train(model, opt, 2, first_seed=2)
    resumed, resumed_opt = build("gpt2", "host")
    tierwise.load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt)
    assert train(resumed, resumed_opt, 2, first_seed=2) == straight
