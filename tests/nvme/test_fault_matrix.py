"""The fault matrix in real training: EIO, ENOSPC and short I/O at setup, chunk fetch, the NVMe
optimizer pipeline, activation swap and checkpoint write. Each gives one clear error (no hang:
a case that does not return within HANG_S ends the test process with every thread's stack),
the model keeps the values of the last completed step, and the last checkpoint resumes bitwise
like a run that never failed. Each case records how long the error took to reach the caller
(``record_property``; bench/resilience.py prints them as the fault-matrix report)."""

from __future__ import annotations

import errno
import faulthandler
import re
import time
import types

import pytest
import tierwise
import torch

pytest.importorskip("tierwise_nvme")

from helpers.models import tiny_batch, tiny_model  # noqa: E402
from helpers.train import train  # noqa: E402
from nvme_helpers import FailingBackend  # noqa: E402
from tierwise.checkpoint.manifest import CheckpointError  # noqa: E402
from tierwise.tiers import PayloadKind  # noqa: E402
from tierwise_nvme import NVMeIOError, NVMeSpaceError  # noqa: E402
from tierwise_nvme.errors import io_error, short_io_error  # noqa: E402

PLAN = dict(
    precision="fp32",
    device="cpu",
    chunk_size=5000,
    cache_blocks=3,
    param_placement="nvme",
    optimizer_placement="nvme",
    activation_offload="nvme",
)
# the optimizer pipeline's updates run in backward (optimizer_overlap="auto" after a step
# without clipping) or after it; with params on the host, updates also overwrite their homes
LATE = "optimizer pipeline, write fails late"
OPTIMIZER_SITES = {
    "optimizer pipeline": {},
    "optimizer pipeline after backward": {"optimizer_overlap": "after-backward"},
    "optimizer pipeline, params on host": {"param_placement": "host"},
    # the failed write completes only when waited for: the pipeline's worker has
    # gone idle and the step's drain is what meets the error
    LATE: {},
}
# what cannot be undone ([Note: a step that failed part way]): optimizer states in memory are
# updated in place, then the new parameters written to NVMe; the engine refuses to go on
REFUSING_SITES = {"parameter write-back": {"optimizer_placement": "host"}}
SITES = (
    "setup",
    "chunk fetch",
    *OPTIMIZER_SITES,
    *REFUSING_SITES,
    "activation swap",
    "checkpoint write",
)
FAULTS = {"EIO": errno.EIO, "ENOSPC": errno.ENOSPC, "short I/O": None}
EXPECTED = {"EIO": NVMeIOError, "ENOSPC": NVMeSpaceError, "short I/O": NVMeIOError}
HANG_S = 600
"""A case still running after this long is a hang (a bound for a loaded machine)."""
MESSAGE = {
    "EIO": r"\[Errno 5\]",
    "ENOSPC": r"is full; free space there",
    "short I/O": r"short (read|write): only \d+ of \d+ bytes",
}


class Injector(FailingBackend):
    """Fails the first request ``fail_if`` accepts with EIO/ENOSPC, or as a transfer that stalled
    after half its bytes (what the backends report for short I/O after their retries). With
    ``late``, the failure is reported only when some transfer of the tier is waited for (a
    request split into pieces ends when its slowest piece does)."""

    def __init__(self, inner, fault: str):
        super().__init__(inner, fail_at=None, code=FAULTS[fault] or errno.EIO)
        self.fault = fault
        self.late = False
        self.held: list = []

    def report_held(self) -> None:
        held, self.held = self.held, []
        for request, error in held:
            request.on_done(error)

    def submit(self, request) -> None:
        if self.fail_if is not None and self.failed is None and self.fail_if(request):
            self.failed = request
            self.failed_at = time.perf_counter()
            size = len(request.buffer)
            error = (
                short_io_error(request.op, request.path, request.offset, size, size // 2)
                if self.fault == "short I/O"
                else io_error(request.op, request.path, request.offset, size, self.code)
            )
            if self.late:
                self.held.append((request, error))
            else:
                request.on_done(error)
            return
        self.submitted += 1
        self.inner.submit(request)


class Injectors(list):
    """Every nvme tier created while it is installed goes through an Injector of ``fault``."""

    fault = "EIO"


@pytest.fixture(autouse=True)
def no_hang():
    """A case that hangs ends the test process after HANG_S seconds, printing every thread's
    stack, instead of stalling the suite."""
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def injectors(monkeypatch):
    import tierwise_nvme.tier as tier_module

    made = Injectors()
    real = tier_module.open_backend

    def open_injecting(options, directory):
        made.append(Injector(real(options, directory), made.fault))
        return made[-1]

    monkeypatch.setattr(tier_module, "open_backend", open_injecting)
    from tierwise_nvme.transfer import NVMeHandle

    wait = NVMeHandle.wait

    def waiting_reports_held_failures(handle):
        for injector in made:
            injector.report_held()
        return wait(handle)

    monkeypatch.setattr(NVMeHandle, "wait", waiting_reports_held_failures)
    return made


def _build(nvme_dir, **overrides):
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return tierwise.setup(model, opt, nvme_path=str(nvme_dir), **{**PLAN, **overrides})


def _flat(value, prefix=""):
    """Every tensor and number of a (nested) state dict, by path."""
    if isinstance(value, dict):
        return {
            k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}/{key}").items()
        }
    if isinstance(value, (list, tuple)):
        return {
            k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}/{i}").items()
        }
    return {prefix: value}


def assert_same_state(model, opt, reference):
    """The model and the optimizer hold exactly the reference run's values (bitwise)."""
    got = model.state_dict()
    assert got.keys() == reference.model.keys()
    for name, value in got.items():
        assert torch.equal(value, reference.model[name]), f"parameter {name} differs"
    states = _flat(opt.state_dict())
    assert states.keys() == reference.optim.keys()
    for path, value in states.items():
        expected = reference.optim[path]
        same = (
            torch.equal(value, expected) if isinstance(value, torch.Tensor) else value == expected
        )
        assert same, f"optimizer state {path} differs"


def _payload(op):
    """A request of ``op`` on a swap file of model data (one file per PayloadKind)."""
    files = [f"-{kind.value}@" for kind in PayloadKind if kind is not PayloadKind.ACTIVATION]
    return lambda request: request.op == op and any(f in request.path for f in files)


def _nth(fail_if, n):
    """Accept the ``n``-th request ``fail_if`` accepts (earlier ones go through)."""
    seen = []

    def accept(request):
        if fail_if(request):
            seen.append(request)
        return len(seen) == n

    return accept


def _arm(injectors, fail_if, *, late: bool = False):
    for injector in injectors:
        injector.fail_if = fail_if
        injector.late = late


def _checkpoint_write_fails(monkeypatch, fault, failed_at: list):
    """torch.save inside save_checkpoint writes half a file, then the disk reports the fault
    (its time appended to ``failed_at``)."""
    import tierwise.checkpoint.directory as ckpt

    real_save = torch.save

    def failing_save(value, path):
        real_save(value, path)
        with open(path, "r+b") as handle:
            handle.truncate(path.stat().st_size // 2)
        code = FAULTS[fault] or errno.EIO
        failed_at.append(time.perf_counter())
        raise OSError(
            code,
            f"{errno.errorcode[code]}: write of {path.name} stopped half way"
            + (" (short write)" if fault == "short I/O" else ""),
            str(path),
        )

    monkeypatch.setattr(ckpt.torch, "save", failing_save)
    return lambda: monkeypatch.setattr(ckpt.torch, "save", real_save)


def run_case(site, fault, nvme_dir, ckpt, injectors, monkeypatch, reference):
    """Inject ``fault`` at ``site``; return (error, seconds from the failing call to the error,
    whether the model kept the values of its last completed step, seconds from the fault to
    the error)."""
    injectors.fault = fault
    kept = True
    failed_at: list[float] = []
    if site == "setup":
        model = tiny_model("llama")
        before = model.state_dict()
        _arm_on_creation = _payload("write")  # the first payload write of the initial values
        import tierwise_nvme.tier as tier_module

        creating = tier_module.open_backend

        def armed(options, directory):
            backend = creating(options, directory)
            backend.fail_if = _arm_on_creation
            return backend

        monkeypatch.setattr(tier_module, "open_backend", armed)
        start = time.perf_counter()
        with pytest.raises(Exception) as info:
            tierwise.setup(
                model,
                torch.optim.AdamW(model.parameters(), lr=1e-2),
                nvme_path=str(nvme_dir),
                **PLAN,
            )
        raised = time.perf_counter()
        kept = not hasattr(model, "_tierwise_engine") and all(
            torch.equal(v, before[k]) for k, v in model.state_dict().items()
        )
        monkeypatch.setattr(tier_module, "open_backend", creating)
    else:
        model, opt = _build(nvme_dir, **{**OPTIMIZER_SITES, **REFUSING_SITES}.get(site, {}))
        train(model, opt, 1)
        writes = []  # the payload writes of one step (all pass)
        _arm(injectors, lambda r: writes.append(r) if _payload("write")(r) else False)
        train(model, opt, 1, first_seed=1)
        _arm(injectors, None)
        mode = tierwise.engine_of(model).optimizer_mode  # where the next step's updates run
        tierwise.save_checkpoint(ckpt, model, opt)
        before = model.state_dict()
        start = time.perf_counter()
        with pytest.raises(Exception) as info:
            if site == "checkpoint write":
                restore = _checkpoint_write_fails(monkeypatch, fault, failed_at)
                try:
                    tierwise.save_checkpoint(ckpt, model, opt)
                finally:
                    restore()
            else:
                # payload writes happen only in optimizer updates, which may start during
                # backward (optimizer_overlap="auto" after a step without clipping)
                _arm(
                    injectors,
                    {
                        "chunk fetch": _payload("read"),
                        # the second chunk's first state: others were written
                        **dict.fromkeys(
                            (*OPTIMIZER_SITES, *REFUSING_SITES), _nth(_payload("write"), 4)
                        ),
                        # the step's last write: nothing after it waits for it
                        LATE: _nth(_payload("write"), len(writes)),
                        "activation swap": lambda r: r.op == "write" and "-activation" in r.path,
                    }[site],
                    late=site == LATE,
                )
                model(**tiny_batch(seed=2)).loss.backward()
                opt.step()
        raised = time.perf_counter()
        _arm(injectors, None)
        kept = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        if site in OPTIMIZER_SITES:
            # [Note: atomic optimizer step]: nothing of the failed step was applied, whether the
            # updates ran in backward or after it; the same engine goes on from the failed
            # step's batch exactly like a run that never failed
            assert mode == ("after-backward" if "after" in site else "in-backward")
            assert_same_state(model, opt, reference)
            opt.zero_grad()
            assert train(model, opt, 2, first_seed=2) == reference.losses
        elif site in REFUSING_SITES:  # [Note: a step that failed part way]
            assert not kept, "the fault was meant to hit after some parameters were written"
            opt.zero_grad()
            model(**tiny_batch(seed=2)).loss.backward()
            with pytest.raises(RuntimeError, match="failed part way.*load the last checkpoint"):
                opt.step()
            with pytest.raises(CheckpointError, match="refused, an optimizer step failed part way"):
                tierwise.save_checkpoint(ckpt, model, opt)
            opt.zero_grad()
            tierwise.load_checkpoint(ckpt, model, opt)  # the same engine goes on from it
            assert train(model, opt, 2, first_seed=2) == reference.losses
        tierwise.engine_of(model).close()
    failed_at += [i.failed_at for i in injectors if i.failed is not None]
    assert failed_at, f"{site}: no fault was injected"
    return info.value, raised - start, kept, raised - min(failed_at)


@pytest.fixture(scope="module")
def reference():
    """A run that never failed (on the host: the same math): the model and optimizer state
    after 2 steps, and the losses of steps 3-4."""
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        chunk_size=5000,
        cache_blocks=3,
        param_placement="host",
        optimizer_placement="host",
    )
    train(model, opt, 2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    optim = {
        k: v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in _flat(opt.state_dict()).items()
    }
    return types.SimpleNamespace(
        model=state, optim=optim, losses=train(model, opt, 2, first_seed=2)
    )


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("site", SITES)
def test_fault_is_one_clear_error_and_the_last_checkpoint_resumes_bitwise(
    nvme_dir, tmp_path, injectors, monkeypatch, reference, site, fault, record_property
):
    ckpt = tmp_path / "ckpt"
    error, seconds, kept, after_fault = run_case(
        site, fault, nvme_dir, ckpt, injectors, monkeypatch, reference
    )
    record_property("error", type(error).__name__)
    record_property("call_to_error_s", round(seconds, 4))
    record_property("fault_to_error_s", round(after_fault, 4))
    message = str(error)
    assert "\n" not in message, message
    if site == "checkpoint write":
        assert isinstance(error, OSError) and "stopped half way" in message
    else:
        assert isinstance(error, EXPECTED[fault]), repr(error)
        assert re.search(MESSAGE[fault], message), message
    # nothing of the failed step is applied anywhere ([Note: atomic optimizer step] for the
    # optimizer pipeline, checked further in run_case)
    assert kept or site in REFUSING_SITES, f"{site}: the failed step changed the model"
    if site == "setup":
        return  # nothing to resume: the run never started
    model, opt = _build(nvme_dir, **REFUSING_SITES.get(site, {}))
    tierwise.load_checkpoint(ckpt, model, opt)
    assert train(model, opt, 2, first_seed=2) == reference.losses
    tierwise.engine_of(model).close()


def test_a_backward_given_up_after_in_backward_updates_applies_none_of_them(
    nvme_dir, injectors, reference
):
    """An activation swap-in fails late in a backward whose optimizer updates run in backward
    ([Note: atomic optimizer step]): none of those updates is applied, and after zero_grad the
    engine trains on like a run that never failed."""
    model, opt = _build(nvme_dir)
    train(model, opt, 1)
    reads = []  # the activation reads of one step (all pass)
    _arm(
        injectors,
        lambda r: reads.append(r) if r.op == "read" and "-activation" in r.path else False,
    )
    train(model, opt, 1, first_seed=1)
    engine = tierwise.engine_of(model)
    assert engine.optimizer_mode == "in-backward" and reads
    updated = engine.pipelines["nvme"].updated
    _arm(injectors, _nth(lambda r: r.op == "read" and "-activation" in r.path, len(reads)))
    with pytest.raises(NVMeIOError):
        model(**tiny_batch(seed=2)).loss.backward()
    _arm(injectors, None)
    assert engine.pipelines["nvme"].updated > updated, "no update ran before the failure"
    assert_same_state(model, opt, reference)
    opt.zero_grad()
    assert train(model, opt, 2, first_seed=2) == reference.losses
    engine.close()
