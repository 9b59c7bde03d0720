"""The README's TRL example runs as written (on a CPU-only machine too), on a tiny saved model,
tokenizer and data, with ``max_steps`` added to its two configs."""

import random
import re
from pathlib import Path

import datasets
from helpers.models import tiny_model
from hf.hf_helpers import tiny_tokenizer

README = Path(__file__).resolve().parents[2] / "README.md"


def trl_example() -> str:
    section = README.read_text().split("## TRL: SFT and DPO", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_trl_example_runs(tmp_path, monkeypatch):
    tokenizer = tiny_tokenizer()
    tokenizer.eos_token = "t126"
    tiny_model("llama").save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    rng = random.Random(0)

    def words():
        return " ".join(f"t{rng.randrange(120)}" for _ in range(rng.randrange(3, 8)))

    chat = datasets.Dataset.from_list(
        [{"prompt": words(), "completion": words()} for _ in range(8)]
    )
    preferences = datasets.Dataset.from_list(
        [{"prompt": words(), "chosen": words(), "rejected": words()} for _ in range(8)]
    )
    code = trl_example().replace("bf16=True,", "bf16=True, max_steps=2, report_to=[],")
    assert code.count("max_steps=2") == 2
    monkeypatch.chdir(tmp_path)
    namespace = {"chat": chat, "preferences": preferences}
    exec(compile(code, "README.md (TRL)", "exec"), namespace)
    assert namespace["trainer"].state.global_step == 2
    assert (tmp_path / "out-sft" / "final" / "config.json").is_file()
