"""tierwise-search: the cost model and automatic plan search.

Implements ``tierwise_make_plan`` (ahead of core's trylast default planner) and adds the
``tierwise plan`` command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierwise.hookspecs import hookimpl

from tierwise_search._version import __version__

if TYPE_CHECKING:
    from tierwise.config import Config
    from tierwise.hardware import Hardware
    from tierwise.plan import Plan
    from tierwise.profile import Profile


@hookimpl
def tierwise_make_plan(profile: Profile, hardware: Hardware, config: Config) -> Plan | None:
    from tierwise_search.search import search_plan

    world = max(1, hardware.world_size)
    if any((p.dp_size or world) != world for p in profile.params):
        # expert/tensor-parallel groups shard over smaller data-parallel groups; the cost model
        # sizes every chunk by one group size, so core's planner (sized per group) decides
        return None
    return search_plan(profile, hardware, config)


@hookimpl(trylast=True)
def tierwise_profile_model(model, example_batch, config: Config) -> Profile | None:
    """setup() with an example batch and no profiler plugin: the analytic profile of a Hugging
    Face causal LM at the batch's shape (what ``tierwise plan`` prices), so the plan predicts a
    step; without it the profile is core's static one, which has no batch shape and gets no
    step prediction. ``trylast``: a profiler plugin's measured profile comes first."""
    from tierwise_search.hf_profile import profile_from_example_batch

    return profile_from_example_batch(model, example_batch, config)


@hookimpl
def tierwise_add_cli_commands(subparsers) -> None:
    from tierwise_search.cli import add_plan_command

    add_plan_command(subparsers)


__all__ = [
    "__version__",
    "tierwise_add_cli_commands",
    "tierwise_make_plan",
    "tierwise_profile_model",
]
