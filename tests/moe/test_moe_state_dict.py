"""Under expert and tensor parallelism ``model.state_dict()`` is the whole model's (HF-loadable)
and ``load_state_dict`` takes a whole model's; a failed setup leaves the model as it was."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_moe")
pytest.importorskip("transformers")

import moe_workers as w  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402

pytestmark = pytest.mark.multiprocess
TOLERANCE = 1e-5


@pytest.mark.parametrize(
    "kind, parallel", [("mixtral", {"expert": 2}), ("llama", {"tensor": 2})], ids=["ep2", "tp2"]
)
def test_state_dict_is_the_whole_model_both_ways(kind, parallel):
    ranks = run_ranks(w.state_dict_run, 2, kind, parallel)

    for result in ranks:
        assert result["strict_load"] and result["shapes_match"] and result["trained"]
        # the single-process HF model loaded from it computes what the parallel model computes
        assert result["saved_error"] <= TOLERANCE
        # an HF model's full state dict loaded into the parallel model computes what HF computes
        assert result["loaded_error"] <= TOLERANCE
        assert result["round_trip"]


def test_failed_setup_leaves_the_model_unchanged():
    ranks = run_ranks(w.atomic_setup_run, 2)

    for result in ranks:
        errors = result["errors"]
        assert "optimizer SGD is not supported" in errors["sgd"]
        assert "chunk_size 16 is below the minimum" in errors["chunk_size"]
        assert "raise device_memory" in errors["device_budget"]
        # the planner refuses the host budget before any tier is made (it counts the same
        # bytes the tiers would: model data plus the load/save buffers)
        assert "host memory binds" in errors["host_budget"]
        assert "raise host_memory" in errors["host_budget"]
        # tensor groups take the world; expert groups would need world x 2 ranks
        assert (
            "expert parallel size 2 times the nested model-parallel size 2 does not divide the "
            "world of 2 ranks" in errors["sizes"]
        )
        assert result["unchanged"] == dict.fromkeys(errors, True)
        # the same model then sets up and trains; its loss is the plain model's
        assert abs(result["loss"] - result["plain_loss"]) <= TOLERANCE * result["plain_loss"]
