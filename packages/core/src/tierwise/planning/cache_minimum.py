"""The fewest rCache blocks one training step needs, from the access pattern.

[Note: the rCache minimum]
The runtime pins a chunk while a module that uses it computes ([Note: access hooks]); a fetch
with every block pinned fails. So the minimum is the largest set of chunks pinned at one
moment, which the access pattern gives:

- forward, and backward of one module: the module's chunks, plus those of every enclosing
  module that owns parameters (it is still computing while its child runs). In backward a
  module is released as soon as its parameters' gradients are in
  ([Note: a module's backward is done when its parameters' gradients are]), or, holding a
  frozen parameter, as soon as the autograd nodes its forward created have run
  ([Note: frozen modules are released after their own nodes]), so modules that share an
  input (q, k, v, LoRA base layers) and embeddings waiting for the end of backward add nothing.
- checkpoint re-forward (non-re-entrant): the block's re-forward runs inside the backward of
  its last module, which stays pinned meanwhile, so each module of the block is counted
  together with the block's last module. Which module runs last needs the traced call order:
  module registration order is not it (OPT registers a layer's final_layer_norm after fc2 and
  runs it before fc1). Without a traced order (a static profile: setup without a profiler's
  example batch) any two modules of the block are counted together, a bound the runtime never
  exceeds; the warm-up's recorded order gives the exact number for the re-layout after it.

Setup refuses a plan below this number before anything is allocated; core's planner and
tierwise-search use the same function, so a plan either of them makes is one setup accepts.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping, Sequence

_NUMBERED = re.compile(r"^(.+?\.\d+)(?=\.|$)")


def recompute_blocks(
    module_params: Mapping[str, Sequence[str]], checkpoint_blocks: Sequence[Sequence[str]] = ()
) -> list[list[str]]:
    """Parameters of each block whose activations may be recomputed: the profile's checkpoint
    blocks, else the numbered entries of module lists (``model.layers.3``), in module order."""
    if checkpoint_blocks:
        return [list(block) for block in checkpoint_blocks]
    blocks: dict[str, list[str]] = {}
    for module, names in module_params.items():
        match = _NUMBERED.match(module)
        if match:
            blocks.setdefault(match.group(1), []).extend(names)
    return list(blocks.values())


def last_module(
    block: Sequence[str],
    module_params: Mapping[str, Sequence[str]],
    forward_order: Sequence[str] = (),
) -> str | None:
    """The module of ``block`` (parameter names) whose forward runs last: the one backward
    reaches first, pinned while the block's forward is re-run. Module order without
    ``forward_order``."""
    owner = {n: module for module, names in module_params.items() for n in names}
    modules = list(dict.fromkeys(owner[n] for n in block if n in owner))
    if not modules:
        return None
    first_use: dict[str, int] = {}
    for i, name in enumerate(forward_order):
        first_use.setdefault(name, i)
    return max(
        modules,
        key=lambda m: (
            min((first_use.get(n, -1) for n in module_params[m]), default=-1),
            modules.index(m),
        ),
    )


def min_cache_blocks(
    module_params: Mapping[str, Sequence[str]],
    chunk_of: Mapping[str, Hashable],
    *,
    recompute: Sequence[Sequence[str]] = (),
    forward_order: Sequence[str] = (),
) -> int:
    """Most rCache chunks pinned at one moment of a training step ([Note: the rCache minimum]).

    ``module_params``: module name -> the parameter names it owns directly (any alias);
    ``chunk_of``: parameter name (every alias) -> its chunk, for chunks that live in the rCache
    only; ``recompute``: parameter names of each block whose forward is re-run in backward;
    ``forward_order``: parameter names in traced forward order (which module of a block runs
    last); empty when no order was traced: then any two modules of a block count together.
    0 when no chunk lives in the rCache.
    """
    own = {
        module: {chunk_of[n] for n in names if n in chunk_of}
        for module, names in module_params.items()
    }
    pinned: dict[str, set] = {}
    for module in module_params:  # with every enclosing module that owns parameters
        chunks = set(own[module])
        parts = module.split(".")
        for i in range(len(parts)):
            chunks |= own.get(".".join(parts[:i]), set())
        pinned[module] = chunks
    most = max((len(c) for c in pinned.values()), default=0)
    owner = {n: module for module, names in module_params.items() for n in names}
    for block in recompute:
        modules = list(dict.fromkeys(owner[n] for n in block if n in owner))
        if not modules:
            continue
        lasts = [last_module(block, module_params, forward_order)] if forward_order else modules
        most = max(most, *(len(pinned[last] | pinned[m]) for last in lasts for m in modules))
    if most == 0 and chunk_of:
        most = 1
    return most
