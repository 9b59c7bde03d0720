"""Issue 38: the plan's CPU prediction for a `tierwise train --from-pretrained` fine-tune of a
33.5M Llama (8k vocabulary, bf16, batch 8 x seq 128) was 16x off. The fixture holds a step of
that run measured on this project's CPU machine and the profile and hardware figures the
profiler and probe measured there (provenance inside; bench/cpu_prediction.py made it): the
prediction from those fixed figures must be within 25% of the measured step. No timing here."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

pytest.importorskip("tierwise_search")

from tierwise import Config  # noqa: E402
from tierwise.hardware import Hardware  # noqa: E402
from tierwise.profile import Profile  # noqa: E402
from tierwise_search.search import search_plan  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "cpu_llama33m.json"


@pytest.fixture(scope="module")
def fixture():
    return json.loads(FIXTURE.read_text())


def _plan(fixture, profile: Profile):
    return search_plan(
        profile, Hardware.from_dict(fixture["hardware"]), Config(**fixture["config"])
    )


def test_the_cpu_step_prediction_is_within_25_percent_of_the_measured_step(fixture):
    steady = [line["cpu_s"] for line in fixture["measured_steps"][1:]]
    assert len(steady) >= 2 and fixture["measured_step_s"] == statistics.median(steady)
    plan = _plan(fixture, Profile.from_dict(fixture["profile"]))
    predicted = plan.predicted_step_s["total"]
    measured = fixture["measured_step_s"]
    assert abs(predicted - measured) / measured <= 0.25, (predicted, measured)
    tokens = fixture["tokens_per_step"]
    assert abs(plan.predicted_tokens_per_s - tokens / measured) / (tokens / measured) <= 0.25


def test_the_backward_comes_from_the_measured_backward_not_a_ratio(fixture):
    """The measured backward of this bf16 CPU run is ~8x its forward (the ratio the cost model
    assumed was 2x): the prediction takes the profiler's measured backward per layer."""
    profile = Profile.from_dict(fixture["profile"])
    plan = _plan(fixture, profile)
    assert plan.predicted_step_s["backward"] == pytest.approx(
        sum(profile.layer_backward_s.values())
    )
    backward = statistics.median(line["backward_cpu_s"] for line in fixture["measured_steps"][1:])
    assert abs(plan.predicted_step_s["backward"] - backward) / backward <= 0.25
    assert any("backward" in r and "measured per layer" in r for r in plan.reasons)
