"""Where each block's activation action comes from: the full precedence table of issue 15 and the
README ("first match wins"): ``activation_policy`` (a later entry over an earlier one), then
``activation_offload="host"|"nvme"`` (every block), then ``activation_checkpointing=True`` (every
block recomputed), then ``activation_offload="auto"`` (the plan's per-block choice, a block's own
entry or the most common among the modules inside it), and ``keep`` for anything left."""

from __future__ import annotations

import pytest
from tierwise.runtime.activations.policy import ActivationPolicyError, resolve_policy

BLOCKS = ["h.0", "h.1", "h.2"]
PLAN = {  # a plan as the search plugin writes it: per block, or per module inside a block
    "h.0": "host",
    "h.1.attn": "recompute",
    "h.1.mlp": "recompute",
    "h.1.ln": "keep",
}
ALL = dict.fromkeys


CASES = [
    # (policy, offload, checkpointing, expected)
    (None, "none", False, ALL(BLOCKS, "keep")),
    (None, "host", False, ALL(BLOCKS, "host")),
    (None, "nvme", False, ALL(BLOCKS, "nvme")),
    (None, "none", True, ALL(BLOCKS, "recompute")),
    # offload host/nvme comes before checkpointing
    (None, "host", True, ALL(BLOCKS, "host")),
    (None, "nvme", True, ALL(BLOCKS, "nvme")),
    # checkpointing comes before auto: the plan is not consulted
    (None, "auto", True, ALL(BLOCKS, "recompute")),
    # auto: the plan's entry, the most common inner entry, keep where it says nothing
    (None, "auto", False, {"h.0": "host", "h.1": "recompute", "h.2": "keep"}),
    # activation_policy comes before everything, for the blocks it matches only
    ({"h.2": "nvme"}, "none", False, {"h.0": "keep", "h.1": "keep", "h.2": "nvme"}),
    ({"h.2": "keep"}, "host", True, {"h.0": "host", "h.1": "host", "h.2": "keep"}),
    ({"h.0": "keep"}, "none", True, {"h.0": "keep", "h.1": "recompute", "h.2": "recompute"}),
    ({"h.2": "nvme"}, "auto", False, {"h.0": "host", "h.1": "recompute", "h.2": "nvme"}),
    # patterns, and a later entry over an earlier one
    ({"h.*": "nvme", "h.1": "keep"}, "host", True, {"h.0": "nvme", "h.1": "keep", "h.2": "nvme"}),
    ({"h.1": "keep", "h.*": "recompute"}, "none", False, ALL(BLOCKS, "recompute")),
    ({"h.[01]": "host"}, "auto", False, {"h.0": "host", "h.1": "host", "h.2": "keep"}),
]


@pytest.mark.parametrize(("policy", "offload", "checkpointing", "expected"), CASES)
def test_each_block_gets_the_action_of_the_first_source_that_names_it(
    policy, offload, checkpointing, expected
):
    got = resolve_policy(
        BLOCKS, policy=policy, offload=offload, checkpointing=checkpointing, plan_policy=PLAN
    )
    assert got == expected


def test_the_plan_is_only_read_under_auto():
    for offload in ("none", "host", "nvme"):
        got = resolve_policy(
            BLOCKS, policy=None, offload=offload, checkpointing=False, plan_policy=PLAN
        )
        assert "recompute" not in got.values(), offload


def test_a_pattern_matching_no_block_is_an_error_listing_the_blocks():
    with pytest.raises(ActivationPolicyError, match=r"'model\.layers\.\*'.*h\.0, h\.1, h\.2"):
        resolve_policy(
            BLOCKS, policy={"model.layers.*": "host"}, offload="auto", checkpointing=True
        )
