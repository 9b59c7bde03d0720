"""TierwiseTrainer launched by torchrun: accelerate starts the process group, tierwise shards."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers
from helpers.models import tiny_model
from hf_helpers import TokenBlocks, logits_of

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
    states = [torch.load(tmp_path / f"state-rank{r}.pt", weights_only=True) for r in range(2)]
    assert states[0].keys() == states[1].keys()
    for name, value in states[0].items():  # consolidated: the same on both ranks
        assert torch.equal(states[1][name], value), name
    saved = {}
    for file in sorted((tmp_path / "saved").glob("*.safetensors")):
        saved.update(safetensors.torch.load_file(file))
    assert saved.keys() == states[0].keys()  # rank 0 wrote the whole trained model
    for name, value in saved.items():
        assert torch.equal(value, states[0][name]), name
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "saved", attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.values()), info  # nothing missing (filled randomly), unexpected, ...
    trained = tiny_model("llama")
    trained.load_state_dict(states[0])
    ids = TokenBlocks(n=2).ids
    assert torch.equal(logits_of(loaded, ids), logits_of(trained, ids))
