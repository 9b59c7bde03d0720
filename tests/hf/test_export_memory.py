"""`tierwise export` holds two parameters (the one written, the next one read) and its fixed
write window, whatever its shard size ([Note: export memory], [Note: pipelined export]),
measured as the exporting process's peak resident memory against a model many times larger."""

import json
import os
import subprocess
import sys

import pytest
import tierwise
import torch
import transformers
from tierwise.train.lora import describe_model
from tierwise.weights.safetensors_io import EXPORT_WINDOW_BYTES

SHARD = 5 * 10**9  # the default: the whole model is one shard
ALLOWANCE = 8 * 2**20
"""Interpreter and allocator slack next to the parameter (which is counted exactly)."""

EXPORT = """
import json, sys
from tierwise.train.export import export

run, out, shard = sys.argv[1], sys.argv[2], int(sys.argv[3])
export(run, out + "-warm", max_shard_bytes=shard)  # imports and first-use allocations

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark to the current RSS
before = status("VmRSS:")
export(run, out, max_shard_bytes=shard)
print(json.dumps({"growth": status("VmHWM:") - before}))
"""


def _model():
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=20,  # the model is over twice the bound below
        num_attention_heads=6,
        num_key_value_heads=6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_export_peak_memory_is_one_parameter_not_a_shard_nor_the_model(tmp_path):
    try:
        open("/proc/self/clear_refs", "w").write("5")
    except OSError:
        pytest.skip("needs Linux /proc/self/clear_refs to reset the RSS high-water mark")
    run = tmp_path / "run"
    model = _model()
    describe_model(run, model)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    biggest = max(p.numel() * 4 for p in model.parameters())
    for name, param in model.named_parameters():  # frozen: a checkpoint of weights only
        param.requires_grad_("norm" in name)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model, opt = tierwise.setup(model, opt, precision="fp32", device="cpu", chunk_size=2**20)
    tierwise.save_checkpoint(run / "checkpoints" / "step-000000", model)
    (run / "checkpoints" / "latest").write_text("step-000000")
    del model, opt

    result = subprocess.run(
        [sys.executable, "-c", EXPORT, str(run), str(tmp_path / "out"), str(SHARD)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    growth = json.loads(result.stdout.strip().splitlines()[-1])["growth"]
    assert [f.name for f in (tmp_path / "out").glob("*.safetensors")] == ["model.safetensors"]
    # one parameter being written, the next one being read, and the staging blocks of the
    # writes in flight; the shard (here the whole model) is streamed to disk, never held
    bound = 2 * biggest + EXPORT_WINDOW_BYTES + ALLOWANCE
    assert growth < bound < model_bytes / 2, (growth, bound, model_bytes)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert sum(p.numel() * 4 for p in loaded.parameters()) == model_bytes
