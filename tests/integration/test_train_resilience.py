"""`tierwise train` under interrupts and damaged checkpoints: Ctrl-C / SIGTERM stop after the step
with a checkpoint and one line, --resume finishes with the uninterrupted run's losses, and a
corrupt newest checkpoint falls back to the previous one."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from tierwise.cli import main
from tierwise.train.metrics import train_losses

TINY = ["--model", "llama", "--size", "tiny", "--batch", "4", "--seq", "64", "--sample-tokens", "0"]
STEPS = 8
PICK = random.Random(19)  # the interrupted steps: drawn once, the same on every run of the suite


def _train(tmp_path, capsys, *args):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = main(["train", *args])
    finally:
        os.chdir(cwd)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run's losses by step."""
    run = tmp_path_factory.mktemp("straight") / "run"
    assert main(["train", *TINY, "--steps", str(STEPS), "--out", str(run)]) == 0
    return train_losses(run / "metrics.jsonl")


@pytest.mark.parametrize(
    ("signum", "after_step"),
    [(signal.SIGINT, PICK.randint(1, STEPS - 2)), (signal.SIGTERM, PICK.randint(1, STEPS - 2))],
    ids=["SIGINT", "SIGTERM"],
)
def test_signal_stops_after_the_step_with_a_checkpoint_and_resume_finishes(
    tmp_path, capsys, straight, signum, after_step
):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the real signal, sent to the child by itself while step `after_step` is finishing (a
    # parent watching stdout could not stop a run of 50 ms steps at a chosen step)
    script = textwrap.dedent(f"""
        import os, sys
        import tierwise.train.run as run
        from tierwise.cli import main
        record = run.step_record
        def signal_at_step(**kwargs):
            if kwargs["step"] == {after_step}:
                os.kill(os.getpid(), {int(signum)})
            return record(**kwargs)
        run.step_record = signal_at_step
        sys.exit(main(sys.argv[1:]))
    """)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            script,
            "train",
            *TINY,
            "--steps",
            str(STEPS),
            "--json",
            "--out",
            str(run),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    stdout, stderr = child.communicate(timeout=600)
    assert child.returncode == 128 + signum, stdout + stderr
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.startswith("tierwise train:")]
    assert len(lines) == 1 and f"resume with: tierwise train --resume {run}" in lines[0], stderr
    stopped_at = int((run / "checkpoints" / "latest").read_text().removeprefix("step-"))
    assert stopped_at == after_step  # the step finished, then the run stopped

    code, out, err = _train(tmp_path, capsys, "--resume", str(run))
    assert code == 0, err
    assert f"at step {stopped_at}" in out
    assert train_losses(run / "metrics.jsonl") == straight  # float equality: bitwise


def test_corrupt_newest_checkpoint_falls_back_with_one_line(tmp_path, capsys, straight):
    run = tmp_path / "run"
    code, _, err = _train(
        tmp_path,
        capsys,
        *TINY,
        "--steps",
        str(STEPS),
        "--stop-after",
        "4",
        "--save-every",
        "2",
        "--out",
        str(run),
    )
    assert code == 0, err
    newest = run / "checkpoints" / "step-000004" / "rank00000-of-00001.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a torn write
    code, out, err = _train(tmp_path, capsys, "--resume", str(run))
    assert code == 0, err
    notes = [line for line in out.splitlines() if "step-000004" in line]
    assert len(notes) == 1 and "resuming from step-000002" in notes[0], out
    assert "bytes, the manifest says" in notes[0]
    assert "at step 2" in out
    assert train_losses(run / "metrics.jsonl") == straight


def test_changing_steps_on_resume_is_refused_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(tmp_path, capsys, *TINY, "--steps", "2", "--out", str(run))[0] == 0
    code, _, err = _train(tmp_path, capsys, "--resume", str(run), "--steps", "4")
    assert code == 2 and err.strip().count("\n") == 0
    assert "cannot change --steps from 2 to 4" in err and "cosine" in err


def test_second_interrupt_aborts_at_once(tmp_path):
    script = textwrap.dedent("""
        import os, signal
        from tierwise.train.interrupts import StopRequest
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            while stop.signum is None:  # the handler runs between bytecodes
                pass
            print("first recorded", flush=True)
            os.kill(os.getpid(), signal.SIGINT)
            while True:
                pass
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 130
    assert done.stdout == "first recorded\n"
    assert done.stderr.strip().count("\n") == 0 and "aborted at once" in done.stderr


def _agree(rank, world):
    from tierwise.train.distributed import World
    from tierwise.train.interrupts import Agreement, StopRequest

    stop = StopRequest()
    if rank == world - 1:  # only the last rank got the signal
        stop.signum = signal.SIGTERM
    agreement = Agreement(World(rank=rank, size=world, device="cpu"), 0)
    return agreement.after_step(stop)


@pytest.mark.multiprocess
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step():
    from helpers.multiproc import run_ranks

    assert run_ranks(_agree, 2) == [(signal.SIGTERM, False)] * 2


@pytest.mark.multiprocess
def test_a_two_process_run_resumes_on_one_process(tmp_path, capsys):
    from helpers.cli import free_port, torchrun_command
    from tierwise.checkpoint.reader import CheckpointReader

    run = tmp_path / "run"
    done = subprocess.run(
        torchrun_command(
            free_port(),
            *("--nproc-per-node", "2"),
            train_args=[*TINY, "--steps", "6", "--stop-after", "3", "--out", str(run)],
        ),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    saved = CheckpointReader(run / "checkpoints" / "step-000003")
    assert saved.world_size == 2
    code, out, err = _train(tmp_path, capsys, "--resume", str(run))
    assert code == 0, err
    assert "resumed" in out and "at step 3" in out
    assert sorted(train_losses(run / "metrics.jsonl")) == [1, 2, 3, 4, 5, 6]
    assert CheckpointReader(run / "checkpoints" / "step-000006").world_size == 1


class _StepClock:
    """A clock on which every optimizer step takes ``minutes_per_step`` minutes: what the
    checkpoint timer reads, moved by the loop's own step records (no sleeping)."""

    def __init__(self, minutes_per_step: float):
        self.seconds_per_step = minutes_per_step * 60
        self.steps = 0

    def monotonic(self) -> float:
        return self.steps * self.seconds_per_step


def _saved_steps(tmp_path, capsys, monkeypatch, minutes_per_step, *args):
    """The steps at which a 7-step run wrote a checkpoint, under a ``_StepClock``."""
    import tierwise.train.checkpoints as checkpoints
    import tierwise.train.interrupts as interrupts
    import tierwise.train.run as run

    clock = _StepClock(minutes_per_step)
    monkeypatch.setattr(interrupts, "time", clock)
    record = run.step_record

    def counting(**kwargs):
        clock.steps = kwargs["step"]
        return record(**kwargs)

    monkeypatch.setattr(run, "step_record", counting)
    saved = []
    save = checkpoints.save

    def recording(run_dir, **kwargs):
        saved.append(kwargs["step"])
        return save(run_dir, **kwargs)

    monkeypatch.setattr(checkpoints, "save", recording)
    code, _, err = _train(
        tmp_path,
        capsys,
        *TINY,
        "--steps",
        "7",
        "--eval-every",
        "100",
        "--out",
        str(tmp_path / "run"),
        *args,
    )
    assert code == 0, err
    return saved


def test_periodic_checkpoints_are_on_by_default(tmp_path, capsys, monkeypatch):
    """No flag: a checkpoint once 30 minutes passed since the last (steps of 12 minutes: after
    steps 3 and 6), and at the end; 100 steps (the step default) are not reached."""
    from tierwise.train.options import TrainOptions

    defaults = TrainOptions()
    assert (defaults.checkpoint_interval, defaults.save_minutes) == (100, 30.0)
    assert _saved_steps(tmp_path, capsys, monkeypatch, 12) == [3, 6, 7]


def test_save_every_overrides_the_periodic_default(tmp_path, capsys, monkeypatch):
    """--save-every 2 --save-minutes 0: by step count only, whatever the clock says."""
    assert _saved_steps(
        tmp_path, capsys, monkeypatch, 12, "--save-every", "2", "--save-minutes", "0"
    ) == [2, 4, 6, 7]


def test_second_ctrl_c_in_a_real_run_aborts_at_once_keeping_the_previous_checkpoint(tmp_path):
    """Two Ctrl-C during step 3 of `tierwise train`: the first is recorded, the second ends the
    process at once (130, one line, no traceback, no checkpoint for step 3); the checkpoint of
    step 2 stays the newest and resumes."""
    run = tmp_path / "run"
    script = textwrap.dedent("""
        import os, signal, sys
        import tierwise.train.interrupts as interrupts
        import tierwise.train.run as run
        from tierwise.cli import main
        requests = []
        enter = interrupts.StopRequest.__enter__
        def remembering(self):
            requests.append(self)
            return enter(self)
        interrupts.StopRequest.__enter__ = remembering
        record = run.step_record
        def ctrl_c_twice_at_step_3(**kwargs):
            if kwargs["step"] == 3:
                os.kill(os.getpid(), signal.SIGINT)
                while requests[-1].signum is None:  # the handler runs between bytecodes
                    pass
                os.kill(os.getpid(), signal.SIGINT)
                while True:
                    pass
            return record(**kwargs)
        run.step_record = ctrl_c_twice_at_step_3
        sys.exit(main(sys.argv[1:]))
    """)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "train",
            *TINY,
            "--steps",
            str(STEPS),
            "--save-every",
            "2",
            "--json",
            "--out",
            str(run),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 130, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    ours = [line for line in done.stderr.splitlines() if line.startswith("tierwise train:")]
    assert len(ours) == 1 and "second SIGINT: aborted at once" in ours[0], done.stderr
    assert (run / "checkpoints" / "latest").read_text() == "step-000002"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-000002"]


NVME_FAILS_AFTER_STEP_3 = """
import errno, os, sys, time
import tierwise.train.run as run
import tierwise_nvme.tier as tier
from tierwise.cli import main
from tierwise_nvme.errors import io_error

armed = []
real_open = tier.open_backend


class FailingDisk:
    \"\"\"The disk under --nvme-path: its first write once armed fails with EIO.\"\"\"

    def __init__(self, inner):
        self.inner = inner

    def submit(self, request):
        if armed and request.op == "write":
            armed.clear()
            print(f"FAULT_AT {time.time()}", file=sys.stderr, flush=True)
            request.on_done(io_error(request.op, request.path, request.offset,
                                     len(request.buffer), errno.EIO))
            return
        self.inner.submit(request)

    def __getattr__(self, name):
        return getattr(self.inner, name)


tier.open_backend = lambda options, directory: FailingDisk(real_open(options, directory))
record = run.step_record


def arm_after_step_3(**kwargs):
    if kwargs["step"] == 3:
        armed.append(True)
    return record(**kwargs)


run.step_record = arm_after_step_3
sys.exit(main(sys.argv[1:]))
"""


def test_a_disk_error_mid_run_is_one_line_and_the_last_checkpoint_resumes(
    tmp_path, capsys, record_property
):
    """EIO on the NVMe tier in step 4 of `tierwise train`: exit 1, one line naming the failed
    write and the resume command, no traceback; --resume from step 2 ends with the losses of a
    run that never failed."""
    pytest.importorskip("tierwise_nvme")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    flags = [
        *TINY,
        "--steps",
        "6",
        "--save-every",
        "2",
        "--eval-every",
        "100",
        "--optimizer-placement",
        "nvme",
        "--nvme-path",
        str(nvme),
    ]
    code, _, err = _train(tmp_path, capsys, *flags, "--out", str(tmp_path / "straight"))
    assert code == 0, err
    run = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            NVME_FAILS_AFTER_STEP_3,
            "train",
            *flags,
            "--json",
            "--out",
            str(run),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    exited = time.time()
    assert done.returncode == 1, done.stdout + done.stderr
    fault_at = [
        float(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("FAULT_AT ")
    ]
    assert len(fault_at) == 1, done.stderr
    record_property("fault_to_exit_s", round(exited - fault_at[0], 3))  # bench/resilience.py
    assert "Traceback" not in done.stderr
    ours = [line for line in done.stderr.splitlines() if line.startswith("tierwise train:")]
    assert len(ours) == 1, done.stderr
    assert "write of" in ours[0] and "[Errno 5]" in ours[0] and str(nvme) in ours[0]
    assert f"step-000002 is intact: resume with: tierwise train --resume {run}" in ours[0]

    code, out, err = _train(tmp_path, capsys, "--resume", str(run))
    assert code == 0, err
    assert "at step 2" in out
    assert train_losses(run / "metrics.jsonl") == train_losses(
        tmp_path / "straight" / "metrics.jsonl"
    )


def test_nvme_path_problems_are_one_line_before_the_run_starts(tmp_path, capsys):
    """A file, or a directory tierwise cannot write, as --nvme-path: one line naming it, exit 2,
    no run directory."""
    pytest.importorskip("tierwise_nvme")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    code, _, err = _train(
        tmp_path,
        capsys,
        *TINY,
        "--optimizer-placement",
        "nvme",
        "--nvme-path",
        str(a_file),
        "--out",
        str(tmp_path / "run1"),
    )
    assert code == 2 and err.strip().count("\n") == 0, err
    assert f"--nvme-path {a_file} is a file, not a directory" in err
    assert not (tmp_path / "run1").exists()
