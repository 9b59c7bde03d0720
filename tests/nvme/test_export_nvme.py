"""Exporting a model whose parameters live on NVMe ([Note: pipelined export]): the chunks are
read from the disk ahead of the writes, and the files are byte for byte those of the same model
exported from host homes, holding the model's values bitwise."""

import safetensors.torch
import tierwise
import torch
from helpers.models import tiny_model
from tierwise.integrations.hf_save import save_pretrained


def _managed(placement: str, nvme_dir, trained: bool):
    torch.manual_seed(0)
    model = tiny_model("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = tierwise.setup(
        model,
        optimizer,
        precision="bf16",
        device="cpu",
        chunk_size=3000,
        param_placement=placement,
        optimizer_placement=placement,
        nvme_path=str(nvme_dir),
    )
    if trained:  # masters that differ from the initial values
        ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def test_nvme_homes_export_the_bytes_host_homes_export(nvme_dir):
    host = _managed("host", nvme_dir / "unused", trained=True)
    (nvme_dir / "tier").mkdir()
    nvme = _managed("nvme", nvme_dir / "tier", trained=True)
    assert any(
        (c.optim.master if c.optim is not None else c.home).tier
        is tierwise.engine_of(nvme).tiers["nvme"]
        for c in tierwise.engine_of(nvme).chunks()
    )
    for dtype in ("fp32", "bf16"):
        a = save_pretrained(host, nvme_dir / f"host-{dtype}", dtype=dtype, max_shard_size=20_000)
        b = save_pretrained(nvme, nvme_dir / f"nvme-{dtype}", dtype=dtype, max_shard_size=20_000)
        files = sorted(p.name for p in a.glob("model*"))
        assert len(files) > 2 and files == sorted(p.name for p in b.glob("model*"))
        for name in files:
            assert (a / name).read_bytes() == (b / name).read_bytes(), (dtype, name)
        written = {}
        for file in b.glob("model-*.safetensors"):
            written.update(safetensors.torch.load_file(file))
        state = nvme.state_dict()  # fp32 masters, read from the disk by the state-dict hook
        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        for name, value in written.items():
            assert torch.equal(value, state[name].to(torch_dtype)), name


def test_a_bf16_export_from_nvme_reads_the_homes_half_the_bytes(nvme_dir):
    """[Note: exporting from the home]: bf16 shards from NVMe homes read the bf16 homes, not
    the fp32 masters (bitwise the same values: the test above), so the disk reads half."""
    model = _managed("nvme", nvme_dir, trained=True)
    tier = tierwise.engine_of(model).tiers["nvme"]
    read = {}
    for dtype in ("fp32", "bf16"):
        before = tier.moved_bytes["nvme->host"]
        save_pretrained(model, nvme_dir / f"out-{dtype}", dtype=dtype, max_shard_size=20_000)
        read[dtype] = tier.moved_bytes["nvme->host"] - before
    assert 0 < read["bf16"] <= read["fp32"] / 2


def test_a_bf16_export_while_gradients_are_pending_writes_the_masters(nvme_dir):
    """Between backward and the update an export still writes the parameters (the masters
    converted), whichever payload holds the gradients meanwhile."""
    model = _managed("nvme", nvme_dir, trained=True)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, labels=ids).loss.backward()  # no step: gradients pending
    out = save_pretrained(model, nvme_dir / "pending", dtype="bf16", max_shard_size=20_000)
    written = {}
    for file in out.glob("model-*.safetensors"):
        written.update(safetensors.torch.load_file(file))
    state = model.state_dict()
    assert written
    for name, value in written.items():
        assert torch.equal(value, state[name].to(torch.bfloat16)), name
