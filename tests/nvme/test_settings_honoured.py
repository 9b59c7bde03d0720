"""NVMe settings are honoured or refused, never silently replaced (issue 28, defect 9): a forced
TIERWISE_NVME_BACKEND=libaio that cannot load (or a file system refusing O_DIRECT) raises a clear
error, where "auto" falls back to a thread pool; optimizer_overlap="in-backward" with several
ranks updates in backward, without a warning (issue 27)."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
import tierwise_nvme.backends as backends  # noqa: E402
import torch  # noqa: E402
from helpers.models import tiny_batch, tiny_model  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402
from tierwise_nvme import NVMeOptions  # noqa: E402
from tierwise_nvme.options import NVMeOptionsError  # noqa: E402


@pytest.fixture
def no_libaio(monkeypatch):
    def unavailable(**kwargs):
        raise OSError("libaio.so.1: cannot open shared object file")

    monkeypatch.setattr(backends, "LibaioBackend", unavailable)
    monkeypatch.setattr(backends, "o_direct_supported", lambda directory: True)


def test_forced_libaio_that_cannot_load_raises(no_libaio, tmp_path):
    with pytest.raises(NVMeOptionsError, match="TIERWISE_NVME_BACKEND=libaio.*libaio.so.1"):
        backends.open_backend(NVMeOptions(backend="libaio"), tmp_path)
    fallback = backends.open_backend(NVMeOptions(backend="auto"), tmp_path)
    assert fallback.name == "threads"
    fallback.close()


def test_forced_libaio_on_a_file_system_without_o_direct_raises(monkeypatch, tmp_path):
    monkeypatch.setattr(backends, "o_direct_supported", lambda directory: False)
    with pytest.raises(NVMeOptionsError, match="refuses O_DIRECT"):
        backends.open_backend(NVMeOptions(backend="libaio"), tmp_path)


def test_setup_with_forced_libaio_that_cannot_load_changes_nothing(
    no_libaio, monkeypatch, tmp_path
):
    monkeypatch.setenv("TIERWISE_NVME_BACKEND", "libaio")
    model = tiny_model("gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NVMeOptionsError, match="TIERWISE_NVME_BACKEND=libaio"):
        tierwise.setup(
            model,
            torch.optim.AdamW(model.parameters()),
            device="cpu",
            optimizer_placement="nvme",
            nvme_path=str(tmp_path),
        )
    assert not hasattr(model, "_tierwise_engine")
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def _in_backward_on_ranks(rank, world, nvme_dir):
    import warnings

    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = tierwise.setup(
            model,
            opt,
            device="cpu",
            precision="fp32",
            chunk_size=5000,
            optimizer_placement="nvme",
            optimizer_overlap="in-backward",
            nvme_path=f"{nvme_dir}/rank{rank}",
        )
    model(**tiny_batch(seed=rank)).loss.backward()
    opt.step()
    engine = tierwise.engine_of(model)
    mode = engine.optimizer.last_update_mode
    engine.close()
    return [str(w.message) for w in caught], mode


@pytest.mark.multiprocess
def test_in_backward_overlap_with_several_ranks_runs_in_backward(tmp_path):
    for messages, mode in run_ranks(_in_backward_on_ranks, 2, str(tmp_path)):
        assert mode == "in-backward"
        assert not [m for m in messages if "optimizer_overlap" in m]
