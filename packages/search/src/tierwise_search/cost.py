"""The cost model: bytes each tier holds and the predicted time of one training step.

Model data per element: parameters ``L_c`` bytes (2 for bf16/fp16, 4 for fp32); optimizer
states of trainable chunks are fp32 master + exp_avg + exp_avg_sq = 12 bytes
(``Setting.optim_bytes``: ~6.03 with int8 moments, 8 with bf16: Config.optimizer_states); frozen
chunks have none. Gradients take no memory of their own where core writes them into the
parameter chunk (bf16/fp16, a home that goes through the rCache, home and optimizer states in
memory: 14 bytes per element, [Note: gradients in the parameter payload] in
``tierwise.chunks.payload``); elsewhere they have a shard of ``L_c`` bytes per element in the
optimizer tier (see [Note: engine memory]). With ZeRO
sharding over N ranks each rank's home tiers hold 1/N of every chunk, rCache blocks hold whole
(gathered) chunks.

[Note: engine memory] The byte counts are core's (``tierwise.chunks.payload.PayloadSpec``) so that
``Plan.device_allowance`` is exactly what the device tier will be asked for: a trainable chunk
that does not keep its gradients in its parameter payload (``PayloadSpec.grads_in_home``: fp32,
a device home the model computes in, an NVMe home with host states) has a gradient shard of
L_c bytes/element in its optimizer tier; gradients on their way to NVMe states (a shard on NVMe,
an NVMe home holding them, a sharded device home's staged copy) have ``grad_offload_buffers``
host buffers of the largest shard in front of them; with fp32 a chunk whose params and optimizer share a tier
keeps only the master copy;
every rCache block is as large as the largest chunk; with several ranks, full-chunk gradient
staging buffers live on the device. With optimizer states on NVMe the optimizer pipeline's
staging buffers (``PIPELINE_BUFFERS``) count as host memory: the same few buffers whatever the
budget, so the minimum host memory a plan needs does not depend on the budget given. Parameters
on NVMe need no host staging (the engine reads a chunk straight into its rCache block).

[Note: step time model] One step is a forward/backward phase followed by an optimizer phase.
- forward/backward: compute = forward + backward (per op class, see [Note: achievable compute])
  + the forward of recomputed layers, from measured layer times or FLOPs (``tierwise_search.compute``).
  Parameter
  fetches (rCache misses), gradient offload, activation swaps and collectives use their own
  links. On CUDA, prefetch on side streams overlaps them with compute, so the phase takes the
  maximum of compute and each link's time (LoHan's model); that needs a spare rCache block to
  prefetch into (and prefetch > 0), otherwise transfers wait for compute and the phase is the sum.
  On CPU the "device" is host RAM: copies and collectives run on the same cores as compute, and
  the engine waits for every fetch (an NVMe chunk is read straight into its rCache block, with no
  host hop), so everything in this phase adds.
- optimizer: chunks whose optimizer states live in host or device memory update in place after
  backward: device Adam on the compute stream; host Adam and uploading updated parameters to the
  device overlap on CUDA (ZeRO-Offload), and add on CPU (the same cores do both).
  Chunks with optimizer states on NVMe go through the NVMe optimizer pipeline, see
  [Note: optimizer pipeline timing].
With ``accumulation_steps`` k the step runs k forward/backward phases, each moving what one
does, and only the last one hosts in-backward updates ([Note: speculation pricing]).
total = forward/backward + optimizer. ``sum`` (all components added) is kept as a tie-breaker:
when a change does not move the binding term it still prefers less traffic.

[Note: optimizer pipeline timing] tierwise-nvme's pipeline reads a chunk's states, updates them
and writes them back while other chunks are read and written (a worker thread and asynchronous
I/O). With one rank and no fp16 loss scaling the engine hands a chunk to it as soon as the
chunk's gradients are complete in backward (``Config.optimizer_overlap`` "auto" from the second
step, or "in-backward": LoHan's active gradient offloading); otherwise every chunk is handed
over when backward ends. The model is a queue in hand-over order: chunk i arrives when its
gradients are final (its last backward step, as a share of the backward part of the
forward/backward phase; ``AccessTrace.grads_final_at``) and is served after the previous one,
finish_i = max(arrive_i, finish_{i-1}) + service_i. On CUDA the service is the slowest of its
read, host Adam and write (three resources in a pipeline). On CPU the disk is the only resource
of its own (DMA): the service is its read plus its write (one disk), while every Adam update of
the pipeline runs on the compute cores: the updates of chunks handed over during backward
lengthen the forward/backward phase, the others run after it; the last chunk's update comes
after its read and before its write, so it adds to the queue's end. The step ends when both the
compute path and the queue are done. A model with one big chunk (its gradients
complete when backward ends) therefore overlaps nothing, and many chunks hide their I/O under
backward except for the last one's.

[Note: speculation pricing] What core's engine does around in-backward updates ([Note:
speculative updates]), priced as it does it:
- a redo must be possible (clipping seen, fp16): every NVMe-optimizer chunk's gradient shard is
  written to disk beside its update (L_c bytes per element on the chunk's pipeline write, ~8% of
  a bf16 step's NVMe bytes);
- accumulation: the updates run in the last of the k backward passes, so the queue's arrivals
  move by the k - 1 earlier phases and only the last phase hides optimizer work;
- rollbacks: with probability ``rollback_rate`` the step is redone after backward: the update
  time of the after-backward path (``optimizer_phase`` of the same placement priced after
  backward), its gradients read back from disk (the host buffers let go of them once written),
  added to the step as ``seconds["rollback"]`` (the expectation: rate x redo);
- host-resident states (``host_in_backward``, CUDA): a chunk's Adam runs on one worker thread
  when its gradients are final, after an undo copy of its stored states reserved in the host
  tier; in hand-over order each chunk whose copy fits the room the model data leaves in
  ``host_budget`` goes early, the others update after backward (``host_early``: no room at all
  means the plan updates them all after backward). The worker is a queue like the NVMe one
  (service: the chunk's Adam; the copy's memcpy is not priced: no host-memory rate is probed).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache

import numpy as np
from tierwise.chunks.payload import PayloadSpec, grad_offload_buffers, grad_offload_bytes
from tierwise.planning.host_minimum import storage_tier_host_bytes
from tierwise.precision import OPTIM_BYTES, optim_bytes

from tierwise_search.belady import AccessTrace, simulate
from tierwise_search.layout import ChunkTable
from tierwise_search.rates import Rates

DEVICE, HOST, NVME = 0, 1, 2
TIERS = ("device", "host", "nvme")
PIPELINE_BUFFERS = 9
"""fp32 staging buffers of the largest shard that the NVMe optimizer pipeline holds in host
memory at least: 3 states x (1 read ahead + 1 updating + 1 writing). The plan counts what the
NVMe tier says it holds (``storage_host_bytes``), at least this."""


@cache
def state_copies(tier: str) -> int:
    """Regions the ``tier`` plugin gives each optimizer-state slab (``Tier.STATE_COPIES``: 2 on
    nvme, whose steps commit atomically, see [Note: atomic optimizer step]); 1 if absent."""
    from tierwise.plugins import get_plugin_host

    return getattr(get_plugin_host().tier_classes().get(tier), "STATE_COPIES", 1)


def storage_host_bytes(
    tier: str,
    config,
    optimizer_buffer_bytes: int = 0,
    *,
    transfer_bytes: int = 0,
    ranks_per_node: int = 1,
) -> int:
    """Host bytes the ``tier`` plugin's own buffers hold at most when its transfers move at
    most ``transfer_bytes``: core's ``storage_tier_host_bytes`` for the registered class, the
    figure core's planner counts too; 0 if it has none."""
    from tierwise.plugins import get_plugin_host

    return storage_tier_host_bytes(
        get_plugin_host().tier_classes().get(tier),
        config,
        optimizer_buffer_bytes,
        transfer_bytes=transfer_bytes,
        ranks_per_node=ranks_per_node,
    )


def _grads_in_home(s: Setting) -> np.ndarray:
    """[param tier, optim tier] -> whether a trainable chunk keeps its gradients in its home
    (``PayloadSpec.grads_in_home``: [Note: gradients in the parameter payload])."""
    return np.array(
        [
            [
                s.payload.grads_in_home(
                    a,
                    b,
                    sharded=s.shard > 1,
                    grads_in_device_home=s.grads_in_device_home,
                    grads_in_nvme_home=s.grads_in_nvme_home,
                )
                for b in TIERS
            ]
            for a in TIERS
        ],
        dtype=bool,
    )


@dataclass(frozen=True, kw_only=True)
class ActivationTraffic:
    """What the activation policy adds to a step."""

    recompute_s: float = 0.0
    """Forward seconds of the recomputed layers (run again in backward)."""
    d2h: float = 0.0
    h2d: float = 0.0
    nvme_read: float = 0.0
    nvme_write: float = 0.0
    host_bytes: int = 0
    """Host memory holding swapped activations."""


@dataclass(frozen=True, kw_only=True)
class Setting:
    """Everything fixed while placement is searched for one chunk size."""

    table: ChunkTable
    trace: AccessTrace
    rates: Rates
    payload: PayloadSpec
    """What a trainable chunk holds (core's [Note: payload spec]): its precision gives L_c, the
    bytes per parameter element, and how the Adam moments are stored."""
    forward_s: float
    """One forward pass on the device, seconds (``tierwise_search.compute``)."""
    backward_s: float
    """One backward pass without recomputation, seconds (``tierwise_search.compute``)."""
    shard: int
    """Ranks a chunk is sharded over (1 = whole chunks on every rank)."""
    prefetch: int
    min_blocks: int
    """rCache blocks the widest step needs (the minimum plan)."""
    staging_blocks: int = 0
    """Full-chunk gradient staging buffers on the device (multi-rank gradient path)."""
    receive_block_numel: int = 0
    """Elements of the receive block a reduction in rank order holds on the device (core's
    [Note: reduction in rank order]); 0: none."""
    optimizer_in_backward: bool = False
    """NVMe optimizer states are updated as each chunk's gradients complete in backward (see
    [Note: optimizer pipeline timing]); False: all of them after backward."""
    activations: ActivationTraffic = field(default_factory=ActivationTraffic)
    nvme_io_host_bytes: int = 0
    """Host bytes of the NVMe tier's own read buffers, wherever it holds anything."""
    nvme_pipeline_host_bytes: int = 0
    """Host bytes of the NVMe optimizer pipeline's pool, when it holds optimizer states."""
    keep_grads_for_redo: bool = False
    """In-backward NVMe updates may be rolled back (clipping seen, or fp16): core's engine then
    writes each offloaded gradient shard to its NVMe region beside the update, so that a redo
    can read it back ([Note: speculation pricing])."""
    accumulation_steps: int = 1
    """Backward passes per optimizer step (Config.accumulation_steps): in-backward updates run
    in the last one only ([Note: speculation pricing])."""
    rollback_rate: float = 0.0
    """Expected share of steps whose speculative updates are rolled back and redone after
    backward ([Note: speculation pricing])."""
    host_in_backward: bool = False
    """Host-resident optimizer states update on a worker thread during backward when their
    undo copies fit (core's [Note: host updates in backward]; priced on CUDA only)."""
    host_budget: int | None = None
    """Host bytes per rank (None: unlimited): what the model data leaves is the room for the
    undo copies of host-resident states."""
    grads_in_device_home: bool = False
    """``Plan.grads_in_device_home`` (one rank, bf16/fp16): trainable device homes hold their
    gradients (14 bytes per element) and go through the rCache (core's [Note: the 14-byte
    device home]); each fetch and each gradient is then a copy in device memory."""
    grads_in_nvme_home: bool = False
    """``Plan.grads_in_nvme_home`` (bf16/fp16): trainable NVMe homes over host states hold
    their gradients (14 bytes per element, 12 of them in host memory: core's [Note: the 14-byte
    NVMe home]); what the host gradient buffers cannot hold is written over the homes in each
    micro-batch and read back by the next one and by the update."""

    @property
    def param_bytes(self) -> int:
        """L_c: bytes per parameter element."""
        return self.payload.param_bytes

    @property
    def optimizer_states(self) -> str:
        """How the Adam moments are stored (Config.optimizer_states): memory counts each chunk's
        stored bytes (int8 pads shards to whole 256-element blocks), traffic ``optim_bytes``."""
        return self.payload.optimizer_states

    @property
    def optim_bytes(self) -> float:
        """Bytes per trainable element of the fp32 master and the moments as stored (12 for
        fp32, 8 for bf16, ~6.03 for int8)."""
        return optim_bytes(self.optimizer_states)

    @property
    def world(self) -> int:
        return self.rates.world_size

    @property
    def shard_sizes(self) -> np.ndarray:
        """Elements of each chunk this rank holds (capacity rounded up to whole shards)."""
        return -(-self.table.capacity // self.shard)

    @property
    def block_numel(self) -> int:
        """Elements per rCache block: the largest chunk (core's engine sizes every block so)."""
        return int(-(-self.table.capacity.max(initial=0) // self.shard) * self.shard)

    def uses_rcache(self, param_tier: np.ndarray) -> np.ndarray:
        """Chunks that pass through rCache blocks: offloaded ones, and with sharding every chunk
        (a device-resident shard is still all-gathered into a block)."""
        if self.shard > 1:
            return np.ones(self.table.n_chunks, bool)
        if self.grads_in_device_home:  # [Note: the 14-byte device home]
            return (param_tier != DEVICE) | self.table.trainable
        return param_tier != DEVICE


@dataclass(frozen=True, kw_only=True)
class Placement:
    """One candidate plan at a fixed chunk size."""

    n_blocks: int
    param_tier: np.ndarray
    """Per global chunk: DEVICE, HOST or NVME."""
    optim_tier: np.ndarray
    """Per global chunk; ignored for frozen chunks."""

    def with_blocks(self, n_blocks: int) -> Placement:
        return replace(self, n_blocks=n_blocks)

    def with_chunk(self, chunk: int, *, param: int | None = None, optim: int | None = None):
        param_tier, optim_tier = self.param_tier.copy(), self.optim_tier.copy()
        if param is not None:
            param_tier[chunk] = param
        if optim is not None:
            optim_tier[chunk] = optim
        return replace(self, param_tier=param_tier, optim_tier=optim_tier)


@dataclass(frozen=True)
class Memory:
    device: int
    host: int
    nvme: int


PARTS_OF_OTHERS = ("total", "forward", "backward", "recompute", "fwd_bwd_phase", "optimizer_phase")
"""Prediction.seconds keys that are sums or parts of other keys (compute = forward + backward +
recompute; the step = the forward/backward phase + the optimizer phase after it)."""


@dataclass(frozen=True)
class Prediction:
    seconds: dict[str, float]
    """compute, h2d, d2h, nvme_read, nvme_write, optimizer, comm, total."""
    fetches: np.ndarray
    """Per chunk rCache fetches in one step."""
    bytes: dict[str, float] = field(default_factory=dict)
    """h2d, d2h, nvme_read, nvme_write, comm: bytes one step moves on each link."""

    @property
    def total(self) -> float:
        return self.seconds["total"]

    @property
    def sum(self) -> float:
        return sum(v for k, v in self.seconds.items() if k not in PARTS_OF_OTHERS)


class CostModel:
    """Memory and step time of placements, memoising rCache simulations."""

    def __init__(self, setting: Setting):
        self.setting = setting
        self._sims: dict[tuple[int, bytes], np.ndarray] = {}

    def fetches(self, placement: Placement) -> np.ndarray:
        cached = self.setting.uses_rcache(placement.param_tier)
        key = (placement.n_blocks, np.packbits(cached).tobytes())
        if key not in self._sims:
            self._sims[key] = simulate(self.setting.trace, placement.n_blocks, cached).fetches
        return self._sims[key]

    def memory(self, placement: Placement) -> Memory:
        """Bytes per tier as core's engine allocates them (see [Note: engine memory])."""
        s = self.setting
        p, o, train = placement.param_tier, placement.optim_tier, s.table.trainable
        shard = s.shard_sizes
        totals = [0, 0, 0]
        for tier in (DEVICE, HOST, NVME):
            home = (p == tier) & ~(s.payload.master_may_be_home & train & (o == tier))
            totals[tier] += s.payload.slab_bytes("home", int(shard[home].sum()))
            copies = state_copies(TIERS[tier])  # [Note: atomic optimizer step]
            stored = sum(s.payload.state_bytes(int(n)) for n in shard[train & (o == tier)])
            totals[tier] += stored * copies
        # gradient shards live in the optimizer tier unless the gradients are written into the
        # parameter payload ([Note: gradients in the parameter payload]); on NVMe, host memory
        # holds GRAD_OFFLOAD_BUFFERS of the largest shard ([Note: active gradient offloading])
        in_home = _grads_in_home(s)[p, o]
        for tier in (DEVICE, HOST, NVME):
            with_shard = train & (o == tier) & ~in_home
            totals[tier] += s.payload.slab_bytes("grad", int(shard[with_shard].sum()))
        # gradients that pass the host buffers: a shard on NVMe, an NVMe home holding them,
        # a device home's staged for NVMe or host states ([Note: gradients staged from a
        # device home])
        staged = in_home & (p == DEVICE) & (o == HOST)
        offloaded = int(
            (
                train
                & (((o == NVME) & ~(in_home & (p == HOST))) | (in_home & (p == NVME)) | staged)
            ).sum()
        )
        if offloaded:
            # the runtime's size (page rounding on CUDA aside: a few KiB the search leaves out)
            totals[HOST] += grad_offload_bytes(
                grad_offload_buffers(offloaded),
                int(shard.max(initial=0)) * s.param_bytes,
                pinned=False,
            )
        block = s.block_numel * s.param_bytes
        if s.uses_rcache(p).any():
            totals[DEVICE] += placement.n_blocks * block
        totals[DEVICE] += s.staging_blocks * block + s.receive_block_numel * s.param_bytes
        # [Note: storage tiers' host buffers]: what setup reserves in the host tier
        if (train & (o == NVME)).any():
            totals[HOST] += max(
                s.nvme_pipeline_host_bytes, PIPELINE_BUFFERS * 4 * int(shard.max(initial=0))
            )
        if (p == NVME).any() or (train & (o == NVME)).any() or s.activations.nvme_write > 0:
            totals[HOST] += s.nvme_io_host_bytes
        totals[HOST] += s.activations.host_bytes
        return Memory(*totals)

    def predict(self, placement: Placement) -> Prediction:
        s, r = self.setting, self.setting.rates
        fetches = self.fetches(placement)
        elems = s.shard_sizes.astype(np.float64)  # this rank's part of each chunk
        shard_bytes = elems * s.param_bytes
        chunk_bytes = shard_bytes * s.shard  # a whole (gathered) chunk
        p, o, train = placement.param_tier, placement.optim_tier, s.table.trainable
        act = s.activations

        # forward/backward phase
        fetched = fetches * shard_bytes
        nvme_fetched = fetched[p == NVME].sum()
        # NVMe chunks reach a CUDA device through host memory; on CPU the read lands in the block
        # [Note: activation swap cost] LoHan's transfer time minus the overlap the runtime gets:
        # on CUDA a swapped block goes device -> pinned host (-> NVMe) on side streams; on a CPU
        # an NVMe swap is written from the saved storage and read back by asynchronous I/O (no
        # copy on the compute cores: it overlaps compute, bench/activations.py measured it
        # hidden), while a host swap is a memcpy on the compute cores (it adds)
        act_h2d, act_d2h = act.h2d, act.d2h
        if r.device_is_host:
            act_h2d, act_d2h = act.h2d - act.nvme_read, act.d2h - act.nvme_write
        h2d_fb = fetched[p == HOST].sum() + (0.0 if r.device_is_host else nvme_fetched) + act_h2d
        nvme_read_fb = nvme_fetched + act.nvme_read
        offload_grad = train & (o != DEVICE)
        d2h_fb = shard_bytes[offload_grad].sum() + act_d2h
        nvme_write_fb = act.nvme_write
        comm = 0.0
        if s.world > 1:
            part = (s.world - 1) / s.world
            if s.shard > 1:  # all-gather every fetch, reduce-scatter every gradient chunk
                comm = part * ((fetches * chunk_bytes).sum() + chunk_bytes[train].sum())
            else:  # replicas: all-reduce gradients
                comm = 2 * part * chunk_bytes[train].sum()
        compute = s.forward_s + s.backward_s + act.recompute_s
        device_copies = 0.0
        if s.grads_in_device_home:  # fetches from device homes, gradients into them: read + write
            copied = fetched[p == DEVICE].sum() + shard_bytes[train & (p == DEVICE)].sum()
            device_copies = 2 * copied / r.memory_bandwidth

        # optimizer phase
        host_opt = elems[offload_grad].sum() / r.host_adam
        device_opt = elems[train & (o == DEVICE)].sum() / r.device_adam
        optim_nvme = train & (o == NVME)
        host_opt_pipe = elems[optim_nvme].sum() / r.host_adam
        nvme_read_opt = elems[optim_nvme].sum() * s.optim_bytes
        nvme_write_opt = elems[optim_nvme].sum() * s.optim_bytes
        # updated parameters go home: uploaded from a host optimizer, written back from a device one
        h2d_opt = shard_bytes[offload_grad & (p == DEVICE)].sum()
        d2h_opt = shard_bytes[train & (o == DEVICE) & (p != DEVICE)].sum()
        nvme_write_opt += shard_bytes[train & (p == NVME)].sum()
        # gradients staged from a device home stay there: never written to disk for a redo
        # or spilled ([Note: gradients staged from a device home])
        to_disk = optim_nvme & ~(_grads_in_home(s)[p, o] & (p == DEVICE))
        if s.optimizer_in_backward and s.keep_grads_for_redo:  # [Note: speculation pricing]
            nvme_write_opt += shard_bytes[to_disk].sum()
        if not s.optimizer_in_backward and to_disk.any():
            # gradient shards the host buffers cannot hold go to disk in backward and come back
            # for the update ([Note: active gradient offloading])
            held = grad_offload_buffers(int(optim_nvme.sum())) * shard_bytes.max()
            spilled = max(0.0, shard_bytes[to_disk].sum() - held)
            nvme_write_fb += spilled
            nvme_read_opt += spilled
        in_nvme_home = train & (p == NVME) & (o == HOST) & _grads_in_home(s)[p, o]
        if in_nvme_home.any():  # [Note: the 14-byte NVMe home]: updated after backward
            held = grad_offload_buffers(int(in_nvme_home.sum())) * shard_bytes.max()
            spilled = max(0.0, shard_bytes[in_nvme_home].sum() - held)
            k = s.accumulation_steps
            nvme_write_fb += spilled  # each micro-batch writes what the buffers cannot hold
            nvme_read_fb += spilled * (k - 1) / k  # a later micro-batch adds to them
            # the update reads them back, and a check first (the norm, fp16's overflow)
            nvme_read_opt += spilled * (1 + s.keep_grads_for_redo)

        t = {
            "h2d_fb": h2d_fb / r.h2d,
            "d2h_fb": d2h_fb / r.d2h,
            "nvme_read_fb": nvme_read_fb / r.nvme_read,
            "nvme_write_fb": nvme_write_fb / r.nvme_write,
            "act_nvme": act.nvme_read / r.nvme_read + act.nvme_write / r.nvme_write,
            "comm": comm / r.interconnect,
            "h2d_opt": h2d_opt / r.h2d,
            "d2h_opt": d2h_opt / r.d2h,
            "nvme_read_opt": nvme_read_opt / r.nvme_read,
            "nvme_write_opt": nvme_write_opt / r.nvme_write,
        }
        links = [t["h2d_fb"], t["d2h_fb"], t["comm"]]
        nvme_fb = max(t["nvme_read_fb"], t["nvme_write_fb"])
        spare = placement.n_blocks - s.min_blocks
        can_prefetch = s.prefetch > 0 and (spare >= 1 or not fetches.any())
        if r.device_is_host:  # the engine waits for model-data reads; swap I/O runs beside
            disk_sync = t["nvme_read_fb"] + t["nvme_write_fb"] - t["act_nvme"]
            phase_fb = max(compute + sum(links) + disk_sync, disk_sync + t["act_nvme"])
        elif can_prefetch:
            phase_fb = max(compute, nvme_fb, *links)
        else:
            phase_fb = max(compute + sum(links), nvme_fb)
        phase_fb += device_copies  # on the compute stream (or cores), beside nothing
        host_in_place = host_opt - host_opt_pipe
        k = s.accumulation_steps
        lead = (k - 1) * phase_fb  # the earlier micro-batches: nothing updates in them
        early = self.host_early(placement)  # [Note: speculation pricing] (CUDA only)
        if r.device_is_host:  # one set of cores: updates (the pipeline's too) and copies add
            stolen, queue_end = self._pipeline_cpu(placement, phase_fb, compute, lead)
            fb_end = lead + phase_fb + stolen
            end = max(fb_end + host_opt - stolen + t["h2d_opt"], queue_end)
        else:
            queue_end = self._pipeline_cuda(placement, phase_fb, compute, lead)
            fb_end = lead + phase_fb
            host_late = host_in_place - elems[early].sum() / r.host_adam
            host_end = max(fb_end, self._host_queue(placement, early, phase_fb, lead)) + host_late
            end = max(host_end, fb_end + t["h2d_opt"], queue_end)
        total = end + device_opt + t["d2h_opt"]
        rollback = 0.0
        speculative = optim_nvme.any() or early.any()
        if s.rollback_rate > 0 and s.optimizer_in_backward and speculative:
            rollback = s.rollback_rate * self._redo_seconds(placement)
            total += rollback
        for key in ("h2d_fb", "d2h_fb", "nvme_read_fb", "nvme_write_fb", "comm"):
            t[key] *= k
        h2d_fb, d2h_fb, nvme_read_fb, nvme_write_fb, comm = (
            k * h2d_fb,
            k * d2h_fb,
            k * nvme_read_fb,
            k * nvme_write_fb,
            k * comm,
        )
        seconds = {
            "forward": k * s.forward_s,
            "backward": k * s.backward_s,
            "recompute": k * act.recompute_s,
            "compute": k * compute,
            "h2d": t["h2d_fb"] + t["h2d_opt"],
            "d2h": t["d2h_fb"] + t["d2h_opt"],
            "nvme_read": t["nvme_read_fb"] + t["nvme_read_opt"],
            "nvme_write": t["nvme_write_fb"] + t["nvme_write_opt"],
            "optimizer": host_opt + device_opt,
            "comm": t["comm"],
            "fwd_bwd_phase": fb_end,
            "optimizer_phase": total - fb_end,
            "total": total,
        }
        if rollback:
            seconds["rollback"] = rollback
        if device_copies:
            seconds["device_copies"] = k * device_copies
        moved = {
            "h2d": h2d_fb + h2d_opt,
            "d2h": d2h_fb + d2h_opt,
            "nvme_read": nvme_read_fb + nvme_read_opt,
            "nvme_write": nvme_write_fb + nvme_write_opt,
            "comm": comm,
        }
        return Prediction(
            {k: float(v) for k, v in seconds.items()},
            fetches,
            {k: float(v) for k, v in moved.items()},
        )

    def host_early(self, placement: Placement) -> np.ndarray:
        """Chunks whose host-resident states update in backward: their undo copies fit the
        room, taken in hand-over order as core's engine reserves them ([Note: speculation
        pricing])."""
        s = self.setting
        host = s.table.trainable & (placement.optim_tier == HOST)
        if s.grads_in_nvme_home:  # these update after backward ([Note: the 14-byte NVMe home])
            host &= placement.param_tier != NVME
        early = np.zeros(s.table.n_chunks, bool)
        if not (s.host_in_backward and s.optimizer_in_backward) or s.rates.device_is_host:
            return early
        room = None if s.host_budget is None else s.host_budget - self.memory(placement).host
        used = 0
        for k in np.argsort(s.trace.grads_final_at(), kind="stable"):
            if not host[k]:
                continue
            copy = s.payload.state_bytes(int(s.shard_sizes[k]))
            if room is None or used + copy <= room:
                used += copy
                early[k] = True
        return early

    def _host_queue(self, placement: Placement, early: np.ndarray, phase_fb: float, lead: float):
        """When the host worker finishes the early updates, from the start of the step."""
        s = self.setting
        if not early.any():
            return 0.0
        compute = s.forward_s + s.backward_s + s.activations.recompute_s
        forward_share = s.forward_s / compute if compute > 0 else 0.0
        ready = forward_share + (1 - forward_share) * s.trace.grads_final_at()[early]
        adam = s.shard_sizes[early].astype(np.float64) / s.rates.host_adam
        order = np.argsort(ready, kind="stable")
        return self._queue(lead + ready[order] * phase_fb, adam[order])

    def _redo_seconds(self, placement: Placement) -> float:
        """A rolled-back step's redo: the after-backward update time of ``placement``, its
        gradients read back from disk ([Note: speculation pricing])."""
        s = self.setting
        after = replace(
            s,
            optimizer_in_backward=False,
            host_in_backward=False,
            keep_grads_for_redo=False,
            rollback_rate=0.0,
            accumulation_steps=1,
        )
        prediction = CostModel(after).predict(placement)
        # the after-backward path keeps what the host gradient buffers hold; a redo finds the
        # gradients on disk
        optim_nvme = s.table.trainable & (placement.optim_tier == NVME)
        shard_bytes = s.shard_sizes[optim_nvme].astype(np.float64) * s.param_bytes
        held = grad_offload_buffers(int(optim_nvme.sum())) * s.shard_sizes.max() * s.param_bytes
        read_back = min(float(shard_bytes.sum()), float(held)) / s.rates.nvme_read
        return prediction.seconds["optimizer_phase"] + read_back

    def _pipeline_jobs(self, placement: Placement, phase_fb: float, compute: float):
        """Per chunk with NVMe optimizer states: read, write and Adam seconds, and when it is
        handed over as a share of the forward/backward phase (1.0: when backward ends)."""
        s, r = self.setting, self.setting.rates
        p, o = placement.param_tier, placement.optim_tier
        pipe = np.flatnonzero(s.table.trainable & (o == NVME))
        elems = s.shard_sizes[pipe].astype(np.float64)
        read = elems * s.optim_bytes / r.nvme_read
        # the new parameter values go home too; those of NVMe-resident parameters to the disk
        write = elems * (s.optim_bytes + s.param_bytes * (p[pipe] == NVME)) / r.nvme_write
        if s.optimizer_in_backward and s.keep_grads_for_redo:  # [Note: speculation pricing]
            write += elems * s.param_bytes / r.nvme_write
        adam = elems / r.host_adam
        if s.optimizer_in_backward:
            forward_share = s.forward_s / compute if compute > 0 else 0.0
            ready = forward_share + (1 - forward_share) * s.trace.grads_final_at()[pipe]
        else:
            ready = np.ones(pipe.size)
        order = np.argsort(ready, kind="stable")
        return read[order], write[order], adam[order], ready[order]

    @staticmethod
    def _queue(arrive: np.ndarray, service: np.ndarray) -> float:
        finish = 0.0
        for when, seconds in zip(arrive.tolist(), service.tolist(), strict=True):
            finish = max(when, finish) + seconds
        return finish

    def _pipeline_cuda(
        self, placement: Placement, phase_fb: float, compute: float, lead: float = 0.0
    ) -> float:
        """When the NVMe optimizer pipeline finishes, seconds from the start of the step (0
        without NVMe optimizer states); see [Note: optimizer pipeline timing]. ``lead``: the
        earlier micro-batches' phases ([Note: speculation pricing])."""
        read, write, adam, ready = self._pipeline_jobs(placement, phase_fb, compute)
        if not read.size:
            return 0.0
        return self._queue(lead + ready * phase_fb, np.maximum(np.maximum(read, write), adam))

    def _pipeline_cpu(
        self, placement: Placement, phase_fb: float, compute: float, lead: float = 0.0
    ):
        """(Adam seconds the pipeline takes from the compute cores during backward, when the
        pipeline finishes), see [Note: optimizer pipeline timing] (``lead`` as in
        ``_pipeline_cuda``)."""
        read, write, adam, ready = self._pipeline_jobs(placement, phase_fb, compute)
        if not read.size:
            return 0.0, 0.0
        during = ready < 1.0
        stolen = float(adam[during].sum())
        fb_end = phase_fb + stolen
        return stolen, self._queue(lead + ready * fb_end, read + write) + float(adam[-1])


__all__ = [
    "DEVICE",
    "HOST",
    "NVME",
    "OPTIM_BYTES",
    "PIPELINE_BUFFERS",
    "storage_host_bytes",
    "TIERS",
    "ActivationTraffic",
    "CostModel",
    "Memory",
    "Placement",
    "Prediction",
    "Setting",
]
