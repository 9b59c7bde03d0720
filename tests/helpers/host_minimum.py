"""The least host budget a refusal names, checked the way every plan-time host test checks it."""

from __future__ import annotations

import pytest
from tierwise.plan import PlanError


def named_host_minimum(setup, phrase: str) -> int:
    """The host budget named by ``setup(1)``'s refusal (which must say ``phrase``); one byte
    less is refused too, naming at least as much (its placement may differ, so it may name
    more)."""
    with pytest.raises(PlanError) as info:
        setup(1)
    need = info.value.need
    assert info.value.tier == "host" and phrase in str(info.value)
    with pytest.raises(PlanError) as below:
        setup(need - 1)
    assert below.value.tier == "host" and below.value.need >= need
    return need


def refused_below(setup, need: int, what: str) -> None:
    """``setup(host_memory)`` of a run that ``what``s ("load" or "save") weights: 1 byte (where
    training does not fit either) and ``need - 1`` (where only the load or save does not) are
    both refused on one line naming exactly ``need``."""
    with pytest.raises(PlanError) as info:
        setup(1)
    assert (info.value.tier, info.value.need) == ("host", need)
    assert f"least host_memory that plans and {what}s is" in str(info.value)
    with pytest.raises(PlanError) as info:
        setup(need - 1)
    err = info.value
    assert (err.tier, err.need, err.limit) == ("host", need, need - 1)
    assert f"while weights {what}" in str(err) and "raise host_memory" in str(err)
    assert "\n" not in str(err)
