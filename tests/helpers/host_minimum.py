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
