"""TierwiseTrainer launched by torchrun: accelerate starts the process group, tierwise shards."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

pytestmark = pytest.mark.multiprocess
HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_torchrun_two_processes(tmp_path):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            str(HERE / "torchrun_train.py"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in ranks:
        assert result["world"] == 2 and result["dp_sizes"] == [2]  # sharded over both ranks
        assert result["wrapped"] != "DistributedDataParallel"
        assert len(result["loss"]) == 3 and result["loss"] == ranks[0]["loss"]  # global mean
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved") is not None
