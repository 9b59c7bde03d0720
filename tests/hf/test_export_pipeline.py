"""The pipelined export ([Note: pipelined export]): the files it writes are byte for byte the
serial write of each tensor converted in order (checked against the safetensors format itself
and against transformers' own save_pretrained), and a failed write leaves no file behind."""

import json
import os
import subprocess
import sys
import threading

import pytest
import safetensors.torch
import tierwise
import torch
import transformers
from tierwise.integrations.hf_save import save_pretrained
from tierwise.weights.read_ahead import read_ahead
from tierwise.weights.safetensors_io import ShardedWriter


def _tensors() -> dict[str, torch.Tensor]:
    """Odd sizes (pieces straddle blocks, bf16 data then fp32 at offsets not 4-aligned),
    a scalar, an empty tensor and integer and bool buffers."""
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, 5, generator=g),
        "big": torch.randn(70_001, generator=g),
        "scalar": torch.tensor(1.5),
        "empty": torch.empty(0, 4),
        "ids": torch.arange(7, dtype=torch.int64),
        "mask": torch.rand(13, generator=g) > 0.5,
        "w": torch.randn(257, 129, generator=g),
    }


def _serial_reference(tensors: dict[str, torch.Tensor], dtype, header_bytes: int) -> bytes:
    """The file as the safetensors format defines it, written one tensor after the other:
    8-byte header length, the JSON header padded with spaces to ``header_bytes``, the data."""
    header, data, at = {}, [], 0
    for name, t in tensors.items():
        out = t.to(dtype) if t.is_floating_point() else t
        raw = out.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if out.numel() else b""
        code = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}
        code[torch.bool] = "BOOL"
        header[name] = {
            "dtype": code[out.dtype],
            "shape": list(t.shape),
            "data_offsets": [at, at + len(raw)],
        }
        data.append(raw)
        at += len(raw)
    text = json.dumps({**header, "__metadata__": {"format": "pt"}}, separators=(",", ":"))
    text = text.encode()
    assert len(text) <= header_bytes
    return (
        header_bytes.to_bytes(8, "little")
        + text
        + b" " * (header_bytes - len(text))
        + (b"".join(data))
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [8 * 4096, 32 << 20])
def test_shards_are_the_serial_write_byte_for_byte(tmp_path, dtype, window):
    tensors = _tensors()
    sizes = {
        n: t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
        for n, t in tensors.items()
    }
    writer = ShardedWriter(tmp_path, sizes, max_bytes=10**9, window_bytes=window)
    for name, t in tensors.items():
        writer.add(name, t, dtype if t.is_floating_point() else None)
    (path,) = writer.close()
    written = path.read_bytes()
    header_bytes = int.from_bytes(written[:8], "little")
    assert written == _serial_reference(tensors, dtype, header_bytes)
    loaded = safetensors.torch.load_file(path)
    for name, t in tensors.items():
        expected = t.to(dtype) if t.is_floating_point() else t
        assert loaded[name].dtype == expected.dtype
        assert torch.equal(loaded[name], expected)
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _gpt2():
    config = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=32, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_save_pretrained_writes_what_transformers_writes(tmp_path, dtype):
    """The same weights saved by transformers and by tierwise load back bitwise equal (every
    tensor transformers wrote, in the dtype asked for), and from_pretrained of tierwise's
    folder gives the plain model's parameters."""
    plain = _gpt2()
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    reference = _gpt2().to(torch_dtype)
    reference.save_pretrained(tmp_path / "transformers")
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = tierwise.setup(
        model, optimizer, precision="fp32", device="cpu", chunk_size=10_000
    )
    save_pretrained(model, tmp_path / "tierwise", dtype=dtype, max_shard_size=40_000)
    theirs = safetensors.torch.load_file(tmp_path / "transformers" / "model.safetensors")
    ours = {}
    for file in (tmp_path / "tierwise").glob("model-*.safetensors"):
        ours.update(safetensors.torch.load_file(file))
    assert set(theirs) <= set(ours)
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype and torch.equal(ours[name], value), name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tierwise")
    for name, param in plain.named_parameters():
        assert torch.equal(loaded.get_parameter(name), param.to(torch_dtype)), name


FILL_A_SMALL_DISK = """
import resource, signal, sys, torch, tierwise
from pathlib import Path
from tierwise.integrations.hf_save import save_pretrained
from tierwise.weights.block_writer import WriteFailed

out = Path(sys.argv[1])
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = tierwise.setup(model, optimizer, precision="fp32", device="cpu")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))  # under one shard of the model
try:
    save_pretrained(model, out, max_shard_size=600_000)
except WriteFailed as err:
    print("failed:", err)
"""


def test_a_write_that_fails_leaves_no_file(tmp_path):
    """A shard the file system refuses to grow (a full disk acts the same) raises an error
    that says so, and no shard, temporary or final, is left."""
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-c", FILL_A_SMALL_DISK, str(out)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    # several O_DIRECT writes are in flight: the one crossing the limit fails with EFBIG ("File
    # too large") or, cut short at the limit, leaves the next one unaligned (EINVAL), whichever
    # the kernel sees first; either way the export stops with the error and leaves nothing
    assert "failed:" in result.stdout, result.stdout
    assert "too large" in result.stdout or "Invalid argument" in result.stdout, result.stdout
    assert list(out.glob("model*")) == []


def test_a_folder_that_cannot_be_made_is_an_error_and_writes_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = tierwise.setup(model, optimizer, precision="fp32", device="cpu")
    with pytest.raises(OSError):
        save_pretrained(model, blocker / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    with pytest.raises(OSError):
        ShardedWriter(tmp_path / "missing", {"x": 4}, max_bytes=100).add("x", torch.ones(1))


def test_read_ahead_yields_in_order_with_a_bounded_number_alive():
    alive, peak, lock = [0], [0], threading.Lock()
    callers = []

    class Value:
        def __init__(self, item):
            self.item = item
            with lock:
                alive[0] += 1
                peak[0] = max(peak[0], alive[0])

        def __del__(self):
            with lock:
                alive[0] -= 1

    def read(item):
        if item % 5 == 0:
            callers.append(threading.get_ident())
        return Value(item)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        got = []
        for value in read_ahead(pool, read, range(20), may_read_ahead=lambda i: i % 5 != 0):
            got.append(value.item)
            del value
    assert got == list(range(20))
    assert peak[0] <= 2  # the one in use and the one read ahead (depth 1)
    assert set(callers) == {threading.get_ident()}  # refused items are read by the caller


def test_export_of_a_corrupt_checkpoint_names_it_and_leaves_nothing(tmp_path, capsys):
    """The checksums are hashed by the export's reads: a flipped byte in the rank file fails the
    export with the checksum error (not whatever the bad byte broke) and OUT_DIR is gone."""
    from tierwise.cli import main
    from tierwise.train.lora import describe_model

    run = tmp_path / "run"
    model = _gpt2()
    describe_model(run, model)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = tierwise.setup(model, optimizer, precision="fp32", device="cpu")
    checkpoint = run / "checkpoints" / "step-000000"
    tierwise.save_checkpoint(checkpoint, model)
    (run / "checkpoints" / "latest").write_text("step-000000")
    assert main(["export", str(run), str(tmp_path / "good")]) == 0
    (rank_file,) = checkpoint.glob("rank*.safetensors")
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the values: the file still parses
    rank_file.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["export", str(run), str(tmp_path / "bad")]) == 2
    assert "does not match its checksum" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def _saved_run(tmp_path):
    """A run folder with one checkpoint of a trained-then-saved fp32 GPT-2 (masters and moments)."""
    from tierwise.train.lora import describe_model

    run = tmp_path / "run"
    model = _gpt2()
    describe_model(run, model)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = tierwise.setup(model, optimizer, precision="fp32", device="cpu")
    model(torch.arange(16).view(1, 16), labels=torch.arange(16).view(1, 16)).loss.backward()
    optimizer.step()
    checkpoint = run / "checkpoints" / "step-000001"
    tierwise.save_checkpoint(checkpoint, model, optimizer)
    (run / "checkpoints" / "latest").write_text("step-000001")
    return run, checkpoint, model.state_dict()


def test_the_cli_export_reads_the_checkpoint_once(tmp_path, monkeypatch):
    """[Note: hashing while reading]: the export hashes the rank file with the reads of its
    values, so every byte of it is read exactly once, and the files it writes are the values."""
    import tierwise.checkpoint.reader as reader_module
    from tierwise.train.export import export

    run, checkpoint, state = _saved_run(tmp_path)
    made = []

    class Recorded(reader_module.HashingReads):
        def __init__(self, path):
            super().__init__(path)
            made.append(self)

    monkeypatch.setattr(reader_module, "HashingReads", Recorded)
    export(run, tmp_path / "out")
    (rank_file,) = checkpoint.glob("rank*.safetensors")
    assert [r.path for r in made] == [rank_file]
    assert (made[0].bytes_read, made[0].reread_bytes) == (rank_file.stat().st_size, 0)
    written = safetensors.torch.load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(v, state[k]) for k, v in written.items())


def test_a_corrupt_byte_the_export_does_not_use_still_fails_it(tmp_path, capsys):
    """The last bytes of the rank file are a moment, which the export never reads as a value:
    the one-pass hash still covers them, so the export fails and leaves nothing."""
    from tierwise.cli import main

    run, checkpoint, _ = _saved_run(tmp_path)
    (rank_file,) = checkpoint.glob("rank*.safetensors")
    data = bytearray(rank_file.read_bytes())
    data[-1] ^= 0x01
    rank_file.write_bytes(bytes(data))
    assert main(["export", str(run), str(tmp_path / "bad")]) == 2
    assert "does not match its checksum" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
