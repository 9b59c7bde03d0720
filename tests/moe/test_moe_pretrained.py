"""setup(weights=...) under expert and tensor parallelism (issue 26): each rank reads only the
experts / blocks it owns from the checkpoint (per-expert legacy tensors included), and the
model it builds is the checkpoint's: its whole-model state dict is bitwise HF's from_pretrained
and its logits are HF's."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("tierwise_moe")
pytest.importorskip("transformers")

import tierwise  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from helpers.models import _config, tiny_model  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402
from tierwise.weights import DirectoryWeights  # noqa: E402

pytestmark = pytest.mark.multiprocess
IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))


def _load_parallel(rank: int, world: int, kind: str, parallel: dict, folder: str) -> dict:
    read = []
    source = DirectoryWeights(folder)
    original = source.read

    def counting_read(key, dim=0, start=0, stop=None):
        value = original(key, dim, start, stop)
        read.append((key, value.numel()))
        return value

    source.read = counting_read
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            _config(kind), attn_implementation="eager"
        )
    model, _ = tierwise.setup(
        model,
        torch.optim.AdamW(model.parameters()),
        weights=source,
        precision="fp32",
        device="cpu",
        parallel=parallel,
    )
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    state, expected = model.state_dict(), reference.state_dict()  # collective
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
        reference_logits = reference(input_ids=IDS).logits
    return {
        "read": read,
        "stored": {k: source.shape(k) for k in source.keys()},
        "bitwise": all(torch.equal(state[n], v) for n, v in expected.items() if n in state),
        "names": sorted(expected) == sorted(k for k in state if k in expected),
        "logits_error": (logits - reference_logits).abs().max().item(),
    }


def test_expert_parallel_ranks_read_only_their_experts(tmp_path):
    tiny_model("qwen2_moe", seed=0).save_pretrained(tmp_path)
    ranks = run_ranks(_load_parallel, 2, "qwen2_moe", {"expert": 2}, str(tmp_path))
    experts = _config("qwen2_moe").num_experts
    for rank, result in enumerate(ranks):
        assert result["bitwise"] and result["names"]
        assert result["logits_error"] <= 1e-5
        read_experts = {
            int(m.group(1))
            for key, _ in result["read"]
            if (m := re.search(r"experts\.(\d+)\.", key))
        }
        half = experts // 2
        assert read_experts == set(range(rank * half, (rank + 1) * half))


def test_tensor_parallel_ranks_read_only_their_blocks(tmp_path):
    tiny_model("llama", seed=0).save_pretrained(tmp_path)
    ranks = run_ranks(_load_parallel, 2, "llama", {"tensor": 2}, str(tmp_path))
    for result in ranks:
        assert result["bitwise"] and result["names"]
        assert result["logits_error"] <= 1e-5
        stored = result["stored"]
        for key, numel in result["read"]:
            if re.search(r"(q|k|v|o|gate|up|down)_proj\.weight", key):
                assert numel * 2 == torch.Size(stored[key]).numel(), key
