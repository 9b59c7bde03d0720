"""The README's `tierwise plan` and `tierwise profile` examples, run as a new user would on a
machine without CUDA (every CUDA call fails the test): each exits 0 and prints a plan or a
profile. Optional parts (``[...]``) are included; ``/mnt/nvme`` becomes a temporary folder and
``path/to/config.json`` OPT-175B's config."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from helpers.cuda_calls import forbid_cuda_calls
from tierwise.cli import main

README = Path(__file__).parents[2] / "README.md"
OPT_175B = {
    "model_type": "opt",
    "hidden_size": 12288,
    "num_hidden_layers": 96,
    "ffn_dim": 49152,
    "num_attention_heads": 96,
    "word_embed_proj_dim": 12288,
    "vocab_size": 50272,
    "max_position_embeddings": 2048,
}


def readme_commands() -> list[list[str]]:
    """The plan/profile command lines of the README's "Plan and profile" section."""
    text = README.read_text()
    section = text[text.index("### Plan and profile for the machine you will train on") :]
    block = section[section.index("```bash\n") + 8 :]
    block = block[: block.index("```")]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split("#")[0].replace("[", " ").replace("]", " ")
        words = shlex.split(line)
        if words[:2] in (["tierwise", "plan"], ["tierwise", "profile"]):
            commands.append(words[1:])
    return commands


COMMANDS = readme_commands()


def test_the_readme_has_plan_and_profile_examples():
    assert {c[0] for c in COMMANDS} == {"plan", "profile"} and len(COMMANDS) >= 4


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c[:5]) for c in COMMANDS])
def test_readme_example_runs_without_cuda(command, tmp_path, monkeypatch, capsys):
    calls = forbid_cuda_calls(monkeypatch)
    (tmp_path / "nvme").mkdir()
    config = tmp_path / "config.json"
    config.write_text(json.dumps(OPT_175B))
    args = [
        {"/mnt/nvme": str(tmp_path / "nvme"), "path/to/config.json": str(config)}.get(a, a)
        for a in command
    ]
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert calls == []
    if "--json" in args:
        result = json.loads(out)
        assert result["n_params"] > 0 and result["peak_activation_bytes"] > 0
        if "--hardware" in args:  # a plan or a prediction for the named GPU
            assert result["predicted_tflops"] > 0 and result["predicted_tokens_per_s"] > 0
    elif args[0] == "plan":
        assert re.search(r"^predicted tokens/s\s+[\d,]+$", out, re.M), out
    else:
        assert "parameters" in out
