"""Shared pieces of the MoE / tensor-parallel tests: models with controllable routing, the
single-process reference loop and the per-rank loop (plain PyTorch: AdamW per rank, gradients
averaged over each parameter's data-parallel group by hand, no tierwise engine).

Rank functions live here (a module importable by spawned ranks) and return plain tensors;
comparisons happen in the test process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers.models import tiny_batch, tiny_model

LR = 1e-3
WEIGHT_DECAY = 0.01
ADAM_EPS = 1e-6
"""Above the float noise of near-zero gradients: q/k gradients of a random tiny model are about
1e-8, and with eps=1e-8 Adam would divide reduction-order noise by itself (both runs use it)."""
STEPS = 5
GLOBAL_BATCH = 4
SEQ = 16
CONSTANT_DIM_VALUE = 1.0
"""Every token embedding gets this value in hidden dim 0, so router inputs have a positive
component there that a router row can use to push its expert out of every top-k."""
UNROUTED_FROM_STEP = {3: 2, 2: 3}
"""Expert -> first step from which it receives no token (expert 3 from step 2; experts 2 and 3,
i.e. every expert of expert-parallel rank 1, from step 3)."""


def build_model(kind: str) -> torch.nn.Module:
    """A tiny fp32 model; MoE routers ignore hidden dim 0 until experts are pushed out."""
    model = tiny_model(kind)
    if routers(model):
        with torch.no_grad():
            model.get_input_embeddings().weight[:, 0] = CONSTANT_DIM_VALUE
            for router in routers(model):
                router.weight[:, 0] = 0.0
    return model


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def push_out_unrouted_experts(model: torch.nn.Module, step: int) -> None:
    """From their step on, the experts of UNROUTED_FROM_STEP get a router logit of about -40."""
    with torch.no_grad():
        for expert, first_step in UNROUTED_FROM_STEP.items():
            if step == first_step:
                for router in routers(model):
                    router.weight[expert, 0] = -10.0


def global_batch() -> dict:
    return tiny_batch(batch=GLOBAL_BATCH, seq=SEQ, seed=1)


def batch_slice(batch: dict, index: int, parts: int) -> dict:
    rows = GLOBAL_BATCH // parts
    return {key: value[index * rows : (index + 1) * rows] for key, value in batch.items()}


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS)


def reference_run(kind: str, steps: int = STEPS, moe: bool = True) -> dict:
    """Single process, the whole global batch: losses, final state dict, per-step routing."""
    model = build_model(kind)
    opt = make_optimizer(model)
    batch = global_batch()
    losses, routed = [], []
    for step in range(steps):
        if moe:
            push_out_unrouted_experts(model, step)
            routed.append(_experts_hit(model, batch))
        loss = model(**batch).loss
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    return {"losses": losses, "state": state, "first_grads": first_grads, "routed": routed}


def _experts_hit(model: torch.nn.Module, batch: dict) -> list[int]:
    """Experts that receive at least one token in any layer for this batch (reference side)."""
    hit: set[int] = set()

    def record(module, args, output):
        _, _, top_k_index = output
        hit.update(top_k_index.unique().tolist())

    handles = [router.register_forward_hook(record) for router in routers(model)]
    with torch.no_grad():
        model(**batch)
    for handle in handles:
        handle.remove()
    return sorted(hit)


def parallel_run(
    rank: int, world: int, kind: str, pattern_name: str, size: int, steps: int = STEPS
) -> dict:
    """One rank of a run with ``pattern_name`` of ``size``; plain AdamW per rank."""
    from tierwise.config import Config
    from tierwise_moe import ExpertParallel, TensorParallel, full_state_dict

    cls = {"expert": ExpertParallel, "tensor": TensorParallel}[pattern_name]
    pattern = cls(size=size, config=Config(device="cpu"), process_group=dist.group.WORLD)
    model = build_model(kind)
    opt = make_optimizer(
        model
    )  # before prepare, as for tierwise.setup: parameters stay the same objects
    pattern.prepare(model)
    # tensor-parallel peers share a batch; expert-parallel ranks each take their own slice
    data_rank, data_parts = (
        (rank // size, world // size) if pattern_name == "tensor" else (rank, world)
    )
    batch = batch_slice(global_batch(), data_rank, data_parts)
    moe = pattern_name == "expert"
    losses, local_rows, zero_grad_experts = [], [], []
    for step in range(steps):
        if moe:
            push_out_unrouted_experts(model, step)
        loss = model(**batch).loss
        loss.backward()
        if moe:
            local_rows.append(_local_rows(model))
            zero_grad_experts.append(_experts_with_zero_grad(model))
        average_gradients(model, pattern)
        if step == 0:
            first_grads = full_gradients(model)
        opt.step()
        opt.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
    full_state = full_state_dict(model)
    return {  # numpy, not tensors: see portable()
        "losses": losses,
        "state": portable(full_state),
        "first_grads": portable(first_grads),
        "local_rows": local_rows,
        "zero_grad_experts": zero_grad_experts,
        "mp_rank": pattern.mesh.mp_rank,
        "mp_ranks": _ranks(pattern.mesh.mp_group),
        "dp_ranks": _ranks(pattern.dp_group()),
        "param_numel": sum(p.numel() for p in model.parameters()),
        "reload_matches": _reload_matches(kind, cls, pattern, model, full_state, batch),
    }


def _ranks(group) -> list[int]:
    return [dist.get_rank()] if group is None else dist.get_process_group_ranks(group)


def _reload_matches(kind, cls, pattern, model, full_state, batch) -> bool:
    """A fresh sharded model loaded from the full state dict gives back the same full state
    dict and the same loss as the model it came from, bitwise."""
    from tierwise_moe import full_state_dict, load_full_state_dict

    fresh_pattern = cls(size=pattern.size, config=pattern.config, process_group=dist.group.WORLD)
    fresh = build_model(kind)
    fresh_pattern.prepare(fresh)
    load_full_state_dict(fresh, full_state)
    again = full_state_dict(fresh)
    with torch.no_grad():
        same_loss = torch.equal(fresh(**batch).loss, model(**batch).loss)
    return same_loss and all(torch.equal(again[name], full_state[name]) for name in full_state)


def average_gradients(model: torch.nn.Module, pattern) -> None:
    """What DDP does, per parameter over its data-parallel group (the world if unclaimed)."""
    for name, param in model.named_parameters():
        group = pattern.dp_group() if pattern.claims(name, param) else dist.group.WORLD
        if param.grad is None:
            raise AssertionError(f"{name} has no gradient on rank {dist.get_rank()}")
        dist.all_reduce(param.grad, group=group)
        param.grad /= dist.get_world_size(group)


def full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's (averaged) gradient, shards gathered into the original shapes."""
    from tierwise_moe.shards import shard_specs

    specs = shard_specs(model)
    return {
        name: specs[name].gather(param.grad) if name in specs else param.grad.clone()
        for name, param in model.named_parameters()
    }


def _model_parallel_ranks(model) -> dict[str, list[int]]:
    """Ranks of this rank's expert- and tensor-parallel groups, read off the sharded modules."""
    from tierwise_moe import ColumnParallelLinear, ShardedExperts

    out = {}
    for module in model.modules():
        if isinstance(module, ShardedExperts):
            out.setdefault("expert", _ranks(module.ep_group))
        if isinstance(module, ColumnParallelLinear):
            out.setdefault("tensor", _ranks(module.tp_group))
    return out


def _sharded_experts(model):
    from tierwise_moe import ShardedExperts

    return [m for m in model.modules() if isinstance(m, ShardedExperts)]


def _local_rows(model) -> list[list[int]]:
    """Rows each local expert computed in the last forward, per MoE layer."""
    return [m.last_tokens_per_expert.tolist() for m in _sharded_experts(model)]


def _experts_with_zero_grad(model) -> list[int]:
    """Global ids of this rank's experts whose gradient is exactly zero in every layer."""
    zero = None
    for m in _sharded_experts(model):
        first = m.ep_rank * m.local_experts
        ids = {
            first + e
            for e in range(m.local_experts)
            if not m.gate_up_proj.grad[e].any() and not m.down_proj.grad[e].any()
        }
        zero = ids if zero is None else zero & ids
    return sorted(zero or ())


def portable(tensors: dict[str, torch.Tensor]) -> dict:
    """Tensors as numpy arrays for the trip back to the test process: torch tensors travel by
    shared-memory file descriptor, which breaks when the rank exits before the parent reads."""
    return {name: tensor.detach().numpy() for name, tensor in tensors.items()}


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| relative to the largest magnitude of ``expected``."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    scale = expected.abs().max().clamp_min(1e-30)
    return ((actual - expected).abs().max() / scale).item()


def capacity_run(rank: int, world: int, capacity_factor: float | None) -> dict:
    """One Mixtral MoE block, expert-parallel over the world with ``capacity_factor``, against
    a brute-force loop over (token, expert) pairs applying the same drop rule on this rank's
    tokens. Returns the largest relative errors of the output and the input gradient."""
    import copy

    from tierwise.config import Config
    from tierwise_moe import ExpertParallel

    block = build_model("mixtral").model.layers[0].mlp
    full_block = copy.deepcopy(block)
    ExpertParallel(
        size=world,
        config=Config(device="cpu"),
        process_group=dist.group.WORLD,
        capacity_factor=capacity_factor,
    ).prepare(block)
    gen = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(1, 24, block.gate.hidden_dim, generator=gen)
    x = hidden.clone().requires_grad_()
    out = block(x)
    out.square().sum().backward()
    x_ref = hidden.clone().requires_grad_()
    out_ref, dropped = brute_force_moe(full_block, x_ref, capacity_factor)
    out_ref.square().sum().backward()
    return {
        "out_error": max_relative_error(out.detach(), out_ref.detach()),
        "grad_error": max_relative_error(x.grad, x_ref.grad),
        "dropped": dropped,
    }


def brute_force_moe(block, x: torch.Tensor, capacity_factor: float | None):
    """Mixtral MoE block output, one (token, expert) pair at a time. With a capacity factor,
    each expert takes the first ceil(factor * pairs / E) pairs in token order; the rest add
    nothing. Returns (output, number of dropped pairs)."""
    import math

    hidden = x.reshape(-1, x.shape[-1])
    _, weights, index = block.gate(hidden)
    experts = block.experts
    num_tokens, top_k = index.shape
    limit = math.inf
    if capacity_factor is not None:
        limit = math.ceil(capacity_factor * num_tokens * top_k / experts.num_experts)
    rows = [hidden.new_zeros(hidden.shape[-1]) for _ in range(num_tokens)]
    dropped = 0
    for expert in range(experts.num_experts):
        taken = 0
        for token in range(num_tokens):
            for slot in range(top_k):
                if index[token, slot] != expert:
                    continue
                if taken >= limit:
                    dropped += 1
                    continue
                taken += 1
                gate, up = (experts.gate_up_proj[expert] @ hidden[token]).chunk(2)
                y = experts.down_proj[expert] @ (experts.act_fn(gate) * up)
                rows[token] = rows[token] + weights[token, slot] * y
    return torch.stack(rows).view_as(x), dropped


def mesh_error_run(
    rank: int, world: int, kind: str, pattern_name: str, size: int, overrides: dict
) -> str:
    """The message of the error preparing ``kind`` (with config ``overrides``) raises."""
    from tierwise.config import Config
    from tierwise_moe import ExpertParallel, TensorParallel

    cls = {"expert": ExpertParallel, "tensor": TensorParallel}[pattern_name]
    pattern = cls(size=size, config=Config(device="cpu"), process_group=dist.group.WORLD)
    try:
        pattern.prepare(tiny_model(kind, **overrides))
    except (TypeError, ValueError) as err:
        return str(err)
    return "no error"


# ----------------------------------------------------------------------------- with the engine
def engine_run(
    rank: int, world: int, kind: str, parallel: dict[str, int], settings: dict, steps: int = STEPS
) -> dict:
    """One rank of ``tierwise.setup(model, AdamW, parallel=parallel, **settings)`` (fp32 unless
    ``settings`` name a precision, cpu), the same data and routing pushes as :func:`parallel_run`."""
    import tierwise
    from tierwise_moe import full_state_dict

    model = build_model(kind)
    opt = make_optimizer(model)
    settings = {"precision": "fp32", **settings}
    model, opt = tierwise.setup(
        model, opt, device="cpu", chunk_size=4096, parallel=parallel, **settings
    )
    engine = tierwise.engine_of(model)
    tensor = parallel.get("tensor", 1)
    batch = batch_slice(global_batch(), rank // tensor, world // tensor)
    moe = "expert" in parallel
    losses = []
    for step in range(steps):
        if moe and step in UNROUTED_FROM_STEP.values():
            state = model.state_dict()  # parameters live in chunks: change them through it
            for name, value in state.items():
                if name.endswith("mlp.gate.weight"):
                    for expert, first_step in UNROUTED_FROM_STEP.items():
                        if step == first_step:
                            value[expert, 0] = -10.0
            model.load_state_dict(state)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
    groups = {
        g.name: {
            "dp_size": g.world,
            "sharded": g.sharded,
            "shard_numel": sum(c.shard_size for c in g.chunks),
            "param_numel": sum(s.numel for c in g.chunks for s in c.slots),
        }
        for g in engine.groups
    }
    return {
        "losses": losses,
        "state": portable(full_state_dict(model)),
        "groups": groups,
        "model_parallel_ranks": _model_parallel_ranks(model),
        "bytes_by_tier": engine.stats()["bytes_by_tier"],
        "activations": engine.stats()["activations"],
    }


# ----------------------------------------------------------------------------- state dicts
LOAD_SEED = 7
"""Seed of the other HF model whose full state dict is loaded into a parallel one."""


def state_dict_run(rank: int, world: int, kind: str, parallel: dict[str, int]) -> dict:
    """A few tierwise steps under ``parallel``, then both ways between ``model.state_dict()``
    and a single-process HF model, on this rank's batch:

    - the tierwise state dict loads strictly into a fresh HF model whose logits are compared
      with the tierwise model's own logits;
    - the full state dict of another HF model loads into the tierwise model, whose logits are
      compared with that HF model's, and whose state dict gives it back.
    """
    import tierwise

    model = build_model(kind)
    opt = make_optimizer(model)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        chunk_size=4096,
        parallel=parallel,
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=3,
    )
    tensor = parallel.get("tensor", 1)
    batch = batch_slice(global_batch(), rank // tensor, world // tensor)
    for _ in range(3):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        own_logits = model(**batch).logits
    state = model.state_dict()  # collective: every rank
    single = build_model(kind)
    load_result = single.load_state_dict(state, strict=True)
    with torch.no_grad():
        single_logits = single(**batch).logits

    other = tiny_model(kind, seed=LOAD_SEED)
    other_state = other.state_dict()
    model.load_state_dict(other_state)  # collective: every rank
    with torch.no_grad():
        loaded_logits = model(**batch).logits
        other_logits = other(**batch).logits
    again = model.state_dict()
    return {
        "strict_load": not load_result.missing_keys and not load_result.unexpected_keys,
        "shapes_match": {n: tuple(v.shape) for n, v in state.items()}
        == {n: tuple(v.shape) for n, v in single.state_dict().items()},
        "trained": any(
            not torch.equal(v, build_model(kind).state_dict()[n]) for n, v in state.items()
        ),
        "saved_error": max_relative_error(single_logits, own_logits),
        "loaded_error": max_relative_error(loaded_logits, other_logits),
        "round_trip": all(torch.equal(again[n], v.float()) for n, v in other_state.items()),
    }


# ----------------------------------------------------------------------------- atomic setup
def _model_facts(model: torch.nn.Module) -> dict:
    """Everything a failed setup must leave as it was: parameter objects, shapes and values,
    module classes, hooks and attributes."""
    hooks = sum(
        len(d)
        for m in model.modules()
        for d in (
            m._forward_pre_hooks,
            m._forward_hooks,
            m._backward_hooks,
            m._backward_pre_hooks,
            m._state_dict_hooks,
            m._load_state_dict_pre_hooks,
        )
    )
    return {
        "params": [
            (n, id(p), tuple(p.shape), p.detach().clone(), sorted(vars(p)))
            for n, p in model.named_parameters()
        ],
        "classes": [(n, type(m)) for n, m in model.named_modules()],
        "hooks": hooks,
        "attrs": [(n, sorted(vars(m))) for n, m in model.named_modules()],
        "load_state_dict": "load_state_dict" in vars(model),
    }


def _same_facts(before: dict, after: dict) -> bool:
    for (n, i, s, v, a), (n2, i2, s2, v2, a2) in zip(
        before["params"], after["params"], strict=True
    ):
        if (n, i, s, a) != (n2, i2, s2, a2) or not torch.equal(v, v2):
            return False
    return all(before[k] == after[k] for k in ("classes", "hooks", "attrs", "load_state_dict"))


def atomic_setup_run(rank: int, world: int) -> dict:
    """Bad inputs to ``setup(parallel={"expert": world})``: the error each raises and whether
    the model was left unchanged; then a good setup of the same model and its first loss against
    the plain model's on this rank's batch."""
    import tierwise

    model = build_model("mixtral")
    opt = make_optimizer(model)
    before = _model_facts(model)
    bad = {
        "sgd": (torch.optim.SGD(model.parameters(), lr=0.1), {}),
        "chunk_size": (opt, {"chunk_size": 16}),
        "device_budget": (opt, {"device_memory": 1000}),
        "host_budget": (
            opt,
            {"param_placement": "host", "optimizer_placement": "host", "host_memory": 100_000},
        ),
        "sizes": (opt, {"parallel": {"tensor": world, "expert": world}}),
    }
    errors, unchanged = {}, {}
    for what, (optimizer, settings) in bad.items():
        settings = {"chunk_size": 4096, "parallel": {"expert": world}, **settings}
        try:
            tierwise.setup(model, optimizer, precision="fp32", device="cpu", **settings)
        except Exception as err:  # noqa: BLE001 - the message is what the test checks
            errors[what] = f"{type(err).__name__}: {err}"
        else:
            errors[what] = "no error"
        unchanged[what] = _same_facts(before, _model_facts(model))
    batch = batch_slice(global_batch(), rank, world)
    with torch.no_grad():
        plain_loss = build_model("mixtral")(**batch).loss.item()
    model, opt = tierwise.setup(
        model, opt, precision="fp32", device="cpu", chunk_size=4096, parallel={"expert": world}
    )
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    return {"errors": errors, "unchanged": unchanged, "loss": loss.item(), "plain_loss": plain_loss}
