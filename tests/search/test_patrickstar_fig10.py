"""PatrickStar's Figure 10 points (the largest GPT it trained on YARD: 8x V100-32GB, 240 GB of
host memory for the node) are plans tierwise accepts, with the model data PatrickStar counts:
14 bytes per parameter (fp16 parameters whose chunks also hold the gradients, fp32 master, m
and v), divided among the ranks.

Table 2 of the paper (``shared/papers/patrickstar.txt``) lists GPT-2-like shapes with sequence
length 1024 and 16 heads; its text extraction scrambles the columns, so the shapes here are the
ones whose arithmetic gives the named sizes (12 x hidden^2 per layer): 12B = 60 layers of 4096
(1 GPU: "from 4B to 12B"), 18B = 90 layers of 4096 (8 GPUs: "from 8B to 18B"; the paper's own
count, 18 x 14 = 252 GB of model data against 32 x 20% x 8 + 240 = 291.2 GB of chunk memory)."""

from __future__ import annotations

import re

import pytest
from tierwise import Config, Hardware
from tierwise.planning.planner import REDUCTION_BLOCKS
from tierwise.planning.totals import model_data_bytes

GB = 10**9
V100 = dict(
    device_type="cuda",
    device_memory=32 * 2**30,  # nvidia-smi memory.total of a V100-SXM2-32GB: 32510 MiB ~ 32 GiB
    device_flops=125e12,  # V100 datasheet: 125 TFLOPS fp16 tensor core
    matmul_efficiency=0.5,
    device_memory_bandwidth=0.8 * 900e9,
    h2d_bandwidth=12e9,  # PCIe Gen3 x16, pinned
    d2h_bandwidth=12e9,
    device_adam_velocity=0.8 * 900e9 / 28,
    host_adam_velocity=1.25e9,
    interconnect_bandwidth=0.8 * 150e9,  # NVLink 2 (300 GB/s total) per direction, 80 %
)
HOST = 240 * GB  # YARD's node: "240 GB CPU memory"

POINTS = [  # (name, layers, hidden, GPUs)
    ("12B on 1 V100", 60, 4096, 1),
    ("18B on 8 V100", 90, 4096, 8),
]


def gpt_params(layers: int, hidden: int, vocab: int = 50257, positions: int = 1024) -> int:
    """Parameters of a GPT-2 shape, by hand: per layer two LayerNorms (4h), attention
    (4h^2 + 4h) and the MLP (8h^2 + 5h); token and position embeddings, the final LayerNorm;
    the LM head is tied to the token embedding."""
    per_layer = 12 * hidden * hidden + 13 * hidden
    return layers * per_layer + vocab * hidden + positions * hidden + 2 * hidden


def per_rank_model_bytes(n_params: int, ranks: int) -> int:
    """PatrickStar's count: 2 (fp16 params, gradients reuse them) + 4 + 4 + 4 (fp32 master, m,
    v) = 14 B/param, sharded over the ranks."""
    return n_params * 14 // ranks


@pytest.mark.parametrize(("name", "layers", "hidden", "gpus"), POINTS)
def test_hand_counted_bytes_fit_the_paper_arithmetic(name, layers, hidden, gpus):
    n = gpt_params(layers, hidden)
    assert n == {60: 12_292_845_568, 90: 18_334_240_768}[layers]
    rows = dict(model_data_bytes(n, n, "fp16"))  # core's count of model data by kind
    assert rows["total"] == 14 * n
    per_rank = per_rank_model_bytes(n, gpus)
    # the memory PatrickStar gives chunks: the host's share plus 20 % of the GPU (its warm-up)
    chunk_room = HOST // gpus + int(0.2 * 32 * GB)
    assert per_rank <= chunk_room, (name, per_rank, chunk_room)


def _plan(layers: int, hidden: int, gpus: int):
    transformers = pytest.importorskip("transformers")
    from tierwise_search.hf_profile import profile_hf_config
    from tierwise_search.search import search_plan

    cfg = transformers.GPT2Config(
        n_embd=hidden, n_layer=layers, n_head=16, n_positions=1024, vocab_size=50257
    )
    profile = profile_hf_config(cfg, batch=4, seq_len=1024, precision="fp16", checkpointing=True)
    hardware = Hardware(**V100, world_size=gpus, gpus_per_node=gpus)
    config = Config(
        device="cuda",
        precision="fp16",
        host_memory=HOST,
        activation_checkpointing=True,
    )
    return profile, search_plan(profile, hardware, config)


PER_RANK = re.compile(r"model data per rank: device ([\d.]+ \w+), host ([\d.]+ \w+), nvme")


@pytest.mark.parametrize(("name", "layers", "hidden", "gpus"), POINTS)
def test_tierwise_plan_accepts_the_point_with_14_bytes_per_parameter(name, layers, hidden, gpus):
    from tierwise.units import parse_bytes

    profile, plan = _plan(layers, hidden, gpus)  # raises PlanError when refused
    assert profile.total_numel == gpt_params(layers, hidden)
    line = next(r for r in plan.reasons if PER_RANK.search(r))
    device, host = (parse_bytes(x.replace(" ", "")) for x in PER_RANK.search(line).groups())
    hand = per_rank_model_bytes(profile.total_numel, gpus)
    # the device figure also holds the rCache blocks and, with several ranks, the gradient
    # staging blocks (fp16 blocks of the largest chunk, REDUCTION_BLOCKS of them)
    block = plan.chunk_size * 2
    staging = REDUCTION_BLOCKS * block if gpus > 1 else 0
    chunks = device - plan.cache_blocks * block - staging + host
    # the plan's chunk data per rank is the hand count plus chunk padding (PatrickStar's Table 3
    # utilisation is >= 90 %; tierwise pads each chunk to a multiple of the ranks): within 5 %
    assert hand * 0.99 <= chunks <= hand * 1.05, (name, device, host, chunks, hand)
    assert host <= HOST // gpus
