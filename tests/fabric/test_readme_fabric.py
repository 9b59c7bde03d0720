"""The README's Lightning Fabric example runs as written, on a tiny saved config and three
batches."""

import re
from pathlib import Path

from helpers.models import tiny_batch, tiny_model

README = Path(__file__).resolve().parents[2] / "README.md"


def fabric_example() -> str:
    section = README.read_text().split("## Lightning Fabric", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_fabric_example_runs(tmp_path, monkeypatch):
    tiny_model("llama").config.save_pretrained(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    namespace = {"loader": [tiny_batch(seed=s) for s in range(3)]}
    exec(compile(fabric_example(), "README.md (Fabric)", "exec"), namespace)
    assert namespace["step"] == 2
    assert (tmp_path / "ckpt").is_dir()
