"""`tierwise train` across two "nodes" on this machine: two torchrun agents (--nnodes 2,
--node-rank 0 and 1, one process each) meet on 127.0.0.1, train and save; the run resumes on one
process of one node."""

from __future__ import annotations

import os
import subprocess

import pytest
from helpers.cli import free_port, torchrun_command
from tierwise.checkpoint.reader import CheckpointReader
from tierwise.cli import main
from tierwise.train.metrics import train_losses

pytestmark = pytest.mark.multiprocess
# --clip 0: one process computes the clip norm as torch.nn.utils.clip_grad_norm_ does (fp32 norms
# per parameter, then their norm); several ranks hold shards that split parameters, so they sum
# the shards' squares in fp64 and take the root. Both round the same norm to fp32, but not always
# to the same last bit (the comparison below is bitwise across world sizes)
TINY = [
    *("--model", "llama", "--size", "tiny", "--batch", "4", "--seq", "64"),
    *("--sample-tokens", "0", "--clip", "0"),
]


def _same_block_corpus(tmp_path):
    """A corpus whose every 64-token training block is the same 64 bytes: any rank count reads
    the same batches, so runs on 2 ranks and on 1 compute the same losses (two ranks average two
    equal gradients, (g + g) / 2 == g exactly)."""
    line = "def f(x):  # the same block every time\n    return x * 2 + 1  #!\n"
    assert len(line.encode()) == 64
    path = tmp_path / "corpus.txt"
    path.write_text(line * 300)
    return path


def _main_in(cwd, args) -> int:
    before = os.getcwd()
    os.chdir(cwd)
    try:
        return main(args)
    finally:
        os.chdir(before)


def test_two_nodes_train_save_and_resume_on_one(tmp_path, capsys):
    port, run, corpus = free_port(), tmp_path / "run", _same_block_corpus(tmp_path)
    tiny = [*TINY, "--data", str(corpus)]
    agents = [
        subprocess.Popen(
            torchrun_command(
                port,
                *("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1"),
                train_args=[*tiny, "--steps", "6", "--stop-after", "3", "--out", str(run)],
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for node in (0, 1)
    ]
    try:
        outputs = [agent.communicate(timeout=600) for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    for agent, (_, err) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, err[-4000:]
    # rank 0 (node 0) reports; node 1's rank prints nothing of the run
    assert "step" in outputs[0][0] and outputs[1][0].strip() == ""
    saved = CheckpointReader(run / "checkpoints" / "step-000003")
    assert saved.world_size == 2
    code = _main_in(tmp_path, ["train", "--resume", str(run)])
    out = capsys.readouterr().out
    assert code == 0
    assert "resumed" in out and "at step 3" in out
    assert sorted(train_losses(run / "metrics.jsonl")) == [1, 2, 3, 4, 5, 6]
    assert CheckpointReader(run / "checkpoints" / "step-000006").world_size == 1
    # the losses of an uninterrupted run (one process, the same batches): 2 ranks for steps 1-3
    # then 1 after the resume, bit for bit
    straight = tmp_path / "straight"
    code = _main_in(tmp_path, ["train", *tiny, "--steps", "6", "--out", str(straight)])
    assert code == 0, capsys.readouterr().err
    assert train_losses(run / "metrics.jsonl") == train_losses(straight / "metrics.jsonl")
