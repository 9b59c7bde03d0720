"""A bad nvme_path is refused at setup in one line naming the path and the fix, before anything
is written there or allocated, and the model is left as it was ([Note: NVMe preflight])."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import tierwise
import torch

pytest.importorskip("tierwise_nvme")

from helpers.models import tiny_model  # noqa: E402
from tierwise.config import ConfigError  # noqa: E402

PLAN = dict(
    precision="fp32",
    device="cpu",
    param_placement="host",
    optimizer_placement="nvme",
    cache_blocks=3,
)


def _setup(nvme_path):
    model = tiny_model("gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ConfigError) as err:
        tierwise.setup(model, opt, nvme_path=str(nvme_path), **PLAN)
    assert not hasattr(model, "_tierwise_engine")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # unchanged
    message = str(err.value)
    assert "\n" not in message and str(nvme_path) in message
    return message


def test_a_file_instead_of_a_directory(tmp_path):
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    message = _setup(path)
    assert "is a file, not a directory" in message and "set nvme_path to a directory" in message


def test_a_read_only_directory(tmp_path, monkeypatch):
    path = tmp_path / "ro"
    path.mkdir()
    path.chmod(0o555)
    if os.geteuid() == 0:  # root writes through permissions: refuse as a read-only mount would
        real_open = os.open

        def read_only_mount(file, flags, *args, **kwargs):
            if str(file).startswith(str(path)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(file))
            return real_open(file, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", read_only_mount)
    message = _setup(path)
    assert "is not writable" in message and "choose a writable directory" in message
    monkeypatch.undo()
    path.chmod(0o755)
    assert list(path.iterdir()) == []


def _small_disk(monkeypatch, directory: Path, free: int) -> None:
    """The file system of ``directory`` reports ``free`` bytes available (statvfs, the OS call)."""
    real = os.statvfs

    def statvfs(target):
        stats = real(target)
        if not str(Path(target).resolve()).startswith(str(directory.resolve())):
            return stats
        blocks = free // stats.f_frsize
        return os.statvfs_result(
            (
                stats.f_bsize,
                stats.f_frsize,
                stats.f_blocks,
                blocks,
                blocks,
                stats.f_files,
                stats.f_ffree,
                stats.f_favail,
                stats.f_flag,
                stats.f_namemax,
            )
        )

    monkeypatch.setattr(os, "statvfs", statvfs)


def test_a_disk_too_small_for_the_plan(tmp_path, monkeypatch):
    path = tmp_path / "small"
    path.mkdir()
    _small_disk(monkeypatch, path, 256 << 10)  # the optimizer states alone are ~1.2 MiB
    # core's planner places what is asked; the search plugin plans around nvme_free itself
    monkeypatch.setenv("TIERWISE_DISABLE_PLUGINS", "search")
    message = _setup(path)
    assert "free, the plan puts" in message and "on NVMe there" in message
    assert list(path.iterdir()) == []


def test_a_disk_with_room_for_the_plan_but_not_128_mib_works(tmp_path, monkeypatch):
    path = tmp_path / "enough"
    path.mkdir()
    _small_disk(monkeypatch, path, 16 << 20)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(model, opt, nvme_path=str(path), **PLAN)
    assert tierwise.engine_of(model).stats()["bytes_by_tier"]["nvme"] > 0
    tierwise.engine_of(model).close()


@pytest.mark.parametrize("libaio", [True, False], ids=["libaio", "no-libaio"])
def test_plugins_command_says_when_the_thread_fallback_is_in_use(monkeypatch, capsys, libaio):
    import tierwise_nvme.backends.libaio_backend as libaio_backend
    from tierwise.cli import main

    def load():
        if not libaio:
            raise OSError("libaio.so.1: cannot open shared object file: No such file or directory")
        return object()

    monkeypatch.setattr(libaio_backend, "load_libaio", load)
    assert main(["plugins"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: nvme")]
    if libaio:
        assert notes == []
    else:
        assert len(notes) == 1 and "thread-pool fallback" in notes[0] and "libaio1" in notes[0]
