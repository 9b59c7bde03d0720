"""The README's Hugging Face Trainer example runs as written, on a CPU-only machine too (issue 30:
transformers refused its bf16=True there without use_cpu=True)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import transformers
from helpers.models import tiny_model
from tierwise.train.data import ByteTokenizer

README = Path(__file__).resolve().parents[2] / "README.md"


def trainer_example() -> str:
    section = README.read_text().split("## Hugging Face Trainer", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (n, 16), generator=gen).tolist()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": list(self.ids[i])}


def test_the_readme_trainer_example_runs_as_written(tmp_path, monkeypatch):
    code = trainer_example()
    assert "use_cpu=not torch.cuda.is_available()" in code
    ByteTokenizer().save_pretrained(tmp_path / "tokenizer")
    names = {
        "model": tiny_model("llama", vocab_size=ByteTokenizer.vocab_size),
        "train": Rows(32, seed=0),
        "held_out": Rows(8, seed=1),
        "tokenizer": transformers.AutoTokenizer.from_pretrained(tmp_path / "tokenizer"),
    }
    monkeypatch.chdir(tmp_path)  # the example writes to ./out
    exec(compile(code, str(README), "exec"), names)
    assert names["trainer"].state.global_step > 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "final")
    assert loaded.config.model_type == "llama"
