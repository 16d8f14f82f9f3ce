"""Per-rank memory of one training step, estimated in one process without a GPU.

``titan-lightning estimate --recipe MOD:FN --world_size N [--rank R] [--json]`` (see cli.py).

How: the fake process group makes this process rank ``rank`` of ``world_size``; the
estimate builds the same mesh and applies the same parallelisms as a real run
(``parallel.parallelize``: PP split, TP, CP, EP, activation checkpointing, compile, FSDP), on
fake tensors (``FakeTensorMode``: shapes, dtypes and storages, no data). Then two training
steps run on a batch of the recipe's shape (``training.microbatch_size`` sequences of
``training.seq_len`` tokens, each packed with ``DOCUMENTS_PER_ROW`` documents, prepared by the
module's ``prepare_batch_on_host`` as a run prepares it, each CP rank keeping its slice;
fake tensors to the model), in the module's order: forward
and loss, backward, optimizer step, ``zero_grad`` (CausalLMModule frees the gradients right
after the step, so none are alive during the next forward). The first step creates the
optimizer state and compiles; during the second, a dispatch mode adds up the bytes of every live storage, and its maximum is
the estimated peak (what ``torch.cuda.max_memory_allocated`` reports over a step).

Modeled:
  - parameters, gradients, optimizer state and buffers: exact local (sharded) bytes;
  - everything autograd saves under the recipe's activation-checkpointing policy, and the
    temporaries of each op while they live (the loss's fp32 logits, or one chunk's of them
    with ``training.loss_chunks``, FSDP's all-gathered
    parameters of the current and prefetched units, the optimizer step's);
  - LoRA: the frozen base as stored (QLoRA's NF4 by its parts), gradients and optimizer state of
    the adapters alone (the routed experts' among them); preference pairs: a ``frozen`` reference
    copy's shards and buffers (and the weights FSDP keeps gathered after its forward), and each
    step's reference forward (``frozen``, ``adapters_off``), as ``attach_reference`` sets it up;
  - mixed precision as the run does it: autocast's bf16 weight copies without FSDP, the
    MixedPrecisionPolicy's unsharded bf16 parameters with FSDP;
  - ``compile.enable``: the blocks and the loss go through AOT autograd with inductor's
    decompositions and min-cut partitioner (what inductor saves for backward), and each
    graph runs eagerly with inductor's fusion approximated: a tensor inside a graph takes
    memory only when it is an input or output of the graph, or an input or output of an op
    inductor does not fuse (matmuls, attention, collectives, scatters, sorts). Pointwise
    ops and reductions between them are fused away.

Assumed, where a real run depends on values fake tensors do not have (the model reads these
assumptions through parallel/value_free.py):
  - MoE routing is balanced: each expert of a layer gets ``tokens * top_k / num_experts``
    of a rank's (token, expert) pairs (the remainder one each to the first experts), and
    under EP every rank sends and receives the same split sizes. Without EP the spread
    does not change the total (the grouped GEMM and the per-expert loop take all of a rank's
    pairs; only the loop's one-expert temporaries grow with the largest share). Under EP real
    imbalance adds up to ``ep - 1`` times the balanced received tokens, and everything the
    local experts compute and save from them (every rank routing all its pairs to this
    rank's experts); the load-balancing bias keeps real runs near balanced, not at it;
  - the routed experts run as on a Hopper-class GPU: ``torch._grouped_mm`` for bf16 tokens,
    the per-expert loop otherwise (the dtype rule of moe.py's ``grouped_mm_available``);
  - ``model.attention = "flex"`` (a GPU kernel: torch has no FlexAttention backward on CPU) is
    estimated as ``varlen``, which saves the same output and log-sum-exp per token (the block
    mask's few bytes aside); as ``sdpa`` with attention sinks or under PP;
  - the all-gather CP attention attends each run of local queries to all the keys before
    its end without the ``causal_lower_right`` mask (a tensor subclass fake tensors refuse):
    the same shapes and the same saved output and logsumexp as SDPA's masked flash kernel.

Not modeled: float8 (``quantize.float8``): the linears are estimated without it (torchao keeps
the high-precision weights and saves the high-precision inputs for the backward, as a plain
linear does; its float8 copies are temporaries); the CUDA kernels themselves (ops run as the
CPU kernels; SDPA's CPU flash kernel saves the same output and logsumexp as the CUDA flash
kernel, other kernels' workspaces are not seen), temporaries inside DTensor ops (TP/CP
redistributions; their outputs are counted), allocator rounding and fragmentation, CUDA
context and NCCL buffers (none of which ``max_memory_allocated`` counts either).

Pipeline parallelism (with FSDP/HSDP/DDP; with TP, CP or EP it is refused): torch's schedules
cannot run under the fake process group, so the rank's stage modules run as the schedule
would at its fullest point: forward on the microbatches each local stage holds at once
(``in_flight``), then backward one by one. The in-flight counts are the schedules' warmup
lengths; the tensors torch keeps for its send/receive buffers are not counted.
"""

import json
import logging
import weakref
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titan_lightning._compat import FAKE_TENSOR_ERRORS, FakeTensor, FakeTensorMode, TorchDispatchMode, dynamo_disable
from titan_lightning._compat import estimate_backend_parts, list_backends, register_backend, tree_leaves
from titan_lightning._compat import unset_fake_temporarily
from titan_lightning.config import validate_job
from titan_lightning.config.validation import apply_precision, validate_estimate
from titan_lightning.models.common import moe
from titan_lightning.optim import build_optimizer
from titan_lightning.parallel.fake import init_fake_process_group, memory_report
from titan_lightning.parallel.mesh import Mesh, ParallelDims, release_dtensor_caches
from titan_lightning.parallel.nf4 import stored_tensors
from titan_lightning.parallel.parallelize import parallelize
from titan_lightning.parallel.pipeline import PipelineSplit, describe_split, stage_autocast
from titan_lightning.parallel.value_free import Assumptions, assuming
from titan_lightning.run import Run

log = logging.getLogger(__name__)
GiB = 2**30
CPU = torch.device("cpu")  # where the fake tensors live
# The torch.compile backend the estimate compiles with, in place of the job's (see below).
COMPILE_BACKEND = "titan_estimate"


class EstimateError(ValueError):
    """A run the estimator cannot model (not a titan_lightning model, or an op that needs tensor
    values); the message is one line. A bad configuration fails validation (ConfigError) first."""


@dataclass(kw_only=True)
class MemoryEstimate:
    """Bytes one rank holds. Gradients exist from the backward to the end of the optimizer
    step, so only ``gradients_at_peak`` of them are part of the peak; ``activations`` is the
    rest of the peak (saved tensors and temporaries)."""

    world_size: int
    rank: int
    layout: str
    batch: str
    parameters: int
    gradients: int
    optimizer_state: int
    buffers: int
    activations: int
    peak: int
    gradients_at_peak: int

    @property
    def static(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.buffers

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "unit": "bytes"}, indent=2)

    def table(self) -> str:
        rows = [("parameters", self.parameters), ("gradients", self.gradients),
                ("  alive at peak", self.gradients_at_peak),
                ("optimizer state", self.optimizer_state), ("buffers", self.buffers),
                ("activations", self.activations), ("peak", self.peak)]
        lines = [f"rank {self.rank} of {self.world_size}: {self.layout}; {self.batch}", f"{'':<18}{'GiB':>9}"]
        lines += [f"  {name:<16}{value / GiB:>9.2f}" for name, value in rows]
        return "\n".join(lines)


def estimate(run: Run, world_size: int, rank: int = 0) -> MemoryEstimate:
    """Estimate rank ``rank``'s memory over one training step of ``run`` on ``world_size`` ranks.

    Validates the job against ``world_size`` first (``ConfigError`` on bad degrees). The run
    is consumed: its module ends up holding the fake-tensor model.
    """
    job, module = run.job, run.module
    if job is None or not hasattr(module, "build_model"):
        raise EstimateError(f"estimate needs a titan_lightning model (a CausalLMModule with a job); got {type(module).__name__}")
    apply_precision(run.trainer.get("precision"), job.training)  # (as the Trainer would: build_trainer)
    validate_job(job, world_size=world_size, max_steps=run.trainer.get("max_steps"))
    validate_estimate(job, world_size, rank)
    if dist.is_initialized():
        raise RuntimeError("estimate() runs its own fake process group; a process group is already initialized")
    backend, float8, attention = job.compile.backend, job.quantize.float8.enable, getattr(job.model, "attention", None)
    job.compile.backend = COMPILE_BACKEND
    job.quantize.float8.enable = False  # (not modeled: see the module's docstring)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with assuming(_assumptions()):
            return _estimate(run, world_size, rank, fake_mode)
    except Exception as err:
        cause = _fake_cause(err)
        if cause is None:
            raise
        raise EstimateError(_unsupported(type(getattr(module, "model", module)).__name__, cause)) from None
    finally:
        job.compile.backend, job.quantize.float8.enable = backend, float8
        if attention is not None:
            job.model.attention = attention
        if dist.is_initialized():
            dist.destroy_process_group()
        release_dtensor_caches()


def _estimate(run: Run, world_size: int, rank: int, fake_mode) -> MemoryEstimate:
    job, module, t = run.job, run.module, run.job.training
    init_fake_process_group(rank, world_size)  # no deterministic collectives: they copy data a real run does not
    mesh = ParallelDims.from_config(job.parallelism, world_size).build_mesh("cpu")
    with torch.device("meta"):
        module.model = module.build_model()
    if getattr(job.model, "attention", None) == "flex":  # (no FlexAttention backward on CPU: module docstring)
        sinks = any(getattr(m, "sinks", None) is not None for m in module.model.modules())
        job.model.attention = "sdpa" if sinks or job.parallelism.pp > 1 else "varlen"
    # The model is sharded on the meta device (as in a real run) and materialized as fake
    # tensors, without the init (fake tensors hold no values, and some init laws read values);
    # device meshes stay real (FSDP builds some while sharding).
    applied = parallelize(module, mesh, job, model=module.model, tp_plan=module.tp_plan,
                          pipeline_plan=module.pipeline_plan, ddp=False)
    if applied.pipeline is not None and rank == 0:
        log.info(f"[pipeline] {describe_split(applied.pipeline.names, job.parallelism, applied.pipeline.placement)}")
    with fake_mode:  # as the module materializes (its storage: a LoRA base frozen in bf16, QLoRA's NF4), no init
        module.allocate(CPU)
        reference = _reference(module, mesh)
    # The frozen reference's shards and buffers, before its forward gathers them: FSDP keeps the
    # weights of a unit that does not reshard after forward (the last one, by default) gathered, as no
    # backward frees them; the rank holds both, which the measured step counts from its start.
    frozen = [] if reference is None else [*reference.parameters(), *reference.buffers()]
    if applied.pipeline is not None:
        return _estimate_pipeline(run, mesh, applied.pipeline, world_size, rank, fake_mode)
    cp = applied.cp
    if cp is not None:  # CP reads its slices' positions on the host: compute them for real
        cp.runs(t.seq_len // job.parallelism.cp, CPU)
    # The batch as the data module hands it over (on the host, with values), then as the module
    # prepares it before the transfer (varlen's document offsets) and CP slices it.
    batch = module.prepare_batch_on_host(host_batch(t.microbatch_size, t.seq_len, pairs=job.preference.enabled))
    batch = batch if cp is None else {key: cp.shard(value) if key in SEQUENCES else value for key, value in batch.items()}
    with fake_mode:
        optimizer = build_optimizer(module.model.parameters(), job.optimizer, CPU)
        step = _TrainingStep(module, optimizer, applied.loss_parallel)
        step(batch)  # creates the optimizer state, compiles
        with _LiveBytes(fake_mode) as live:
            live.add_static(module, optimizer, frozen + ([] if reference is None else list(reference.parameters())))
            step.live = live
            step(batch)
    return _result(module, step.memory, live, mesh, world_size, rank,
                   f"{t.microbatch_size} x {t.seq_len} tokens per microbatch", frozen)


DOCUMENTS_PER_ROW = 4
SEQUENCES = ("input_ids", "labels", "position_ids", "sequence_ids")  # a batch's [B, S] tensors, which CP slices


def host_batch(rows: int, seq_len: int, pairs: bool = False) -> dict[str, torch.Tensor]:
    """A microbatch of ``rows`` windows of ``seq_len`` tokens as the data module hands one over, on
    the host: token ids, labels and ``position_ids``, each row packed with ``DOCUMENTS_PER_ROW``
    documents (what ``block_causal`` masks, ``per_document`` positions and varlen's document offsets
    read; the bytes of the masks and kernels do not depend on where the boundaries fall). Under the
    fake mode the step's ops take it as fake tensors. ``pairs``: preference pairs (data/preference.py),
    each document a sequence slot and two a pair, their reference log-probabilities with them (as a
    step holds them, whichever ``preference.reference`` gave them)."""
    tokens = torch.zeros(rows, seq_len, dtype=torch.long)
    positions = (torch.arange(seq_len) % -(-seq_len // DOCUMENTS_PER_ROW)).expand(rows, seq_len).contiguous()
    batch = {"input_ids": tokens, "labels": tokens, "position_ids": positions}
    if pairs:
        batch["sequence_ids"] = torch.cumsum(positions == 0, dim=1) - 1
        batch["sequence_docs"] = torch.arange(DOCUMENTS_PER_ROW).expand(rows, DOCUMENTS_PER_ROW).contiguous()
        batch["reference_logps"] = torch.zeros(rows, DOCUMENTS_PER_ROW)
    return batch


def _result(module, held: dict[str, int], live, mesh: Mesh, world_size: int, rank: int, batch: str,
            frozen: Sequence[torch.Tensor] = ()) -> MemoryEstimate:
    """``frozen``: a preference run's frozen reference model's parameters (sharded) and buffers,
    which the rank holds too (no gradients, no optimizer state)."""
    buffers = sum(_local(b).untyped_storage().nbytes() for b in module.model.buffers())
    copy = [p for p in frozen if isinstance(p, torch.nn.Parameter)]
    buffers += sum(_local(b).untyped_storage().nbytes() for b in frozen if not isinstance(b, torch.nn.Parameter))
    parameters = held["parameters"] + sum(s.numel() * s.element_size() for p in copy for s in stored_tensors(_local(p)))
    at_peak = parameters + held["gradients_at_peak"] + held["optimizer_state"] + buffers
    return MemoryEstimate(
        world_size=world_size, rank=rank, layout=mesh.dims.describe(), batch=batch,
        parameters=parameters, gradients=held["gradients"], optimizer_state=held["optimizer_state"],
        buffers=buffers, activations=max(live.peak - at_peak, 0), peak=live.peak,
        gradients_at_peak=held["gradients_at_peak"],
    )


def _reference(module, mesh: Mesh) -> Optional[torch.nn.Module]:
    """A preference run's reference forward in every step (``preference.reference`` "frozen" or
    "adapters_off"; ``validate_preference`` refuses both under PP), set up as the run sets it up
    (``CausalLMModule.attach_reference``), so the measured step runs it; returns the frozen copy
    of the model, sharded like it (None for "adapters_off": the same model, its adapters off)."""
    pref = module.job.preference
    if not (pref.enabled and pref.needs_reference and pref.reference in ("frozen", "adapters_off")):
        return None
    return module.attach_reference(mesh)


# -- pipeline parallelism ---------------------------------------------------------------------


def in_flight(schedule: str, pp_rank: int, pp: int, local: list[int], microbatches: int) -> list[int]:
    """Microbatches whose activations each local stage holds at once, at the schedule's fullest
    point (its last warmup forward, before the first backward frees one), as torch's schedules
    order them: GPipe and LoopedBFS run every forward first; 1F1B holds pp - rank; the
    interleaved and zero-bubble schedules warm up with (stages per rank - 1) x pp + 2 x
    (pp - 1 - rank) forward chunks plus the first steady one, pp microbatches per local stage
    in turn (ZBV: the V's second stage runs its warmup in the same rounds)."""
    v = len(local)
    if schedule in ("GPipe", "LoopedBFS"):
        return [microbatches] * v
    if schedule == "1F1B":
        return [min(microbatches, pp - pp_rank)]
    chunks = min(microbatches * v, (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)
    held = [0] * v
    for chunk in range(chunks):
        held[(chunk // pp) % v] += 1
    return [min(h, microbatches) for h in held]


def _estimate_pipeline(run: Run, mesh: Mesh, split: PipelineSplit, world_size: int, rank: int,
                       fake_mode) -> MemoryEstimate:
    job, module = run.job, run.module
    t, p, fsdp = job.training, job.parallelism, mesh.dims.fsdp_enabled
    pp_rank, pp = mesh.rank_and_size("pp")
    rows = t.microbatch_size // p.pp_microbatches
    held = in_flight(p.pp_schedule, pp_rank, pp, split.local, p.pp_microbatches)
    # What travels between stages: the residual stream, in the dtype the blocks compute in.
    hidden = getattr(torch, t.mixed_precision_param if fsdp else t.dtype)
    m = job.model  # each stage takes the microbatch's document boundaries when the model reads them
    batch = host_batch(rows, t.seq_len, pairs=job.preference.enabled)  # (its labels: the last stage's loss)
    positions = batch["position_ids"] if (m.mask, m.positions) != ("causal", "global") else None
    with fake_mode:
        optimizer = build_optimizer(module.model.parameters(), job.optimizer, CPU)
        step = _PipelineStep(module, optimizer, split.stages, split.local, len(split.names), held, rows, t.seq_len,
                             job.model.dim, hidden, batch, positions)
        with stage_autocast(t, fsdp, CPU.type):  # what the strategy runs the schedule under
            step()  # creates the optimizer state, compiles
            with _LiveBytes(fake_mode) as live:
                live.add_static(module, optimizer)
                step.live = live
                step()
    placed = ", ".join(f"stage {s}: {h}" for s, h in zip(split.local, held))
    return _result(module, step.memory, live, mesh, world_size, rank,
                   f"{p.pp_schedule}, {p.pp_microbatches} microbatches of {rows} x {t.seq_len} tokens, in flight {placed}")


class _PipelineStep:
    """A pipeline step at its fullest: each local stage runs forward on the microbatches it holds at
    once (a fake input from the previous stage, whose gradient the next stage would send back),
    then they run backward one after another, then the optimizer steps."""

    live: Optional["_LiveBytes"] = None  # set for the measured step

    def __init__(self, module, optimizer, stages, local, num_stages, held, rows, seq_len, dim, hidden,
                 batch: dict[str, torch.Tensor], positions: Optional[torch.Tensor] = None) -> None:
        self.module, self.optimizer, self.stages, self.positions = module, optimizer, stages, positions
        self.batch = batch
        self.local, self.last, self.held = local, num_stages - 1, held
        self.shape, self.hidden = (rows, seq_len), (rows, seq_len, dim, hidden)

    def __call__(self) -> None:
        pending = []
        for stage_id, stage, count in zip(self.local, self.stages, self.held):
            for _ in range(count):
                if stage_id == 0:
                    x = torch.zeros(self.shape, dtype=torch.long)
                else:
                    *shape, dtype = self.hidden
                    x = torch.zeros(shape, dtype=dtype, requires_grad=True)
                out = stage(x) if self.positions is None else stage(x, self.positions)
                out = out[0] if isinstance(out, tuple) else out  # (hidden states, position_ids) to the next stage
                if stage_id == self.last:  # the objective's loss, as the last stage's loss function runs it
                    out, _ = self.module.objective.loss(out, self.batch)
                pending.append(out)
                del x, out
        while pending:
            out = pending.pop(0)
            out.backward() if out.dim() == 0 else out.backward(torch.ones_like(out))
            del out
        self.memory = _optimizer_step(self.module, self.optimizer, self.live)


# -- what fake tensors cannot compute: MoE routing, the CP mask (parallel/value_free.py) -------

def _fake_cause(err: BaseException):
    """The fake-tensor error ``err`` is or wraps (torch.compile wraps them), or None."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, FAKE_TENSOR_ERRORS):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _unsupported(model: str, err: Exception) -> str:
    op = getattr(err, "func", None)
    what = f"{op} needs tensor values" if op is not None else f"{type(err).__name__}: {err}"
    return f"the estimator cannot model {model}: {what}, which fake tensors do not have"


def balanced_counts(pairs: int, num_experts: int) -> list[int]:
    """``pairs`` (token, expert) pairs spread evenly over ``num_experts``, the remainder one
    each to the first experts (the routing the estimate assumes)."""
    q, r = divmod(pairs, num_experts)
    return [q + (e < r) for e in range(num_experts)]


@dynamo_disable  # a graph break, as the loop's host read of the counts makes in a real run
def _real_counts(counts: list[int]) -> torch.Tensor:
    """Counts as a real (not fake) int64 tensor: ``.tolist()`` reads them on the host."""
    with unset_fake_temporarily():
        return torch.tensor(counts, dtype=torch.int64)


@dynamo_disable
def _balanced_count_tokens(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """moe.count_tokens of a fake tensor (the router's expert ids): balanced counts."""
    if not isinstance(_local(experts), FakeTensor):
        return moe.count_tokens(experts, num_experts)
    return _real_counts(balanced_counts(experts.numel(), num_experts))


def _grouped_mm_on_gpu(x: torch.Tensor) -> bool:
    """moe.grouped_mm_available on a Hopper-class GPU: bf16 tokens take ``torch._grouped_mm``."""
    return hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16


def _balanced_splits(ep, counts: torch.Tensor):
    """``ExpertParallel.splits`` (parallel/expert.py) of ``ep`` with every rank routing like this one,
    evenly: computed on the host instead of exchanged and read back."""
    n_local = counts.numel() // ep.size
    sent = balanced_counts(sum(counts.tolist()), counts.numel())
    input_splits = [sum(sent[j * n_local:(j + 1) * n_local]) for j in range(ep.size)]
    mine = sent[ep.rank * n_local:(ep.rank + 1) * n_local]
    return input_splits, [list(mine) for _ in range(ep.size)], _real_counts([ep.size * c for c in mine])


def _assumptions() -> Assumptions:
    """Where the model reads tensor values, the estimate's assumptions (module docstring): balanced
    MoE routing, the GPU's grouped GEMM, all-gather CP attention without its mask (SDPA unmasked
    keeps the shapes and saved tensors of the masked kernel)."""
    return Assumptions(count_tokens=_balanced_count_tokens, grouped_mm=_grouped_mm_on_gpu,
                       ep_splits=_balanced_splits, lower_right_mask=False)


def _optimizer_step(module, optimizer, live: Optional["_LiveBytes"]) -> dict[str, int]:
    """The objective's end of the step (its reductions: ``CausalLMModule`` runs it before clipping),
    the optimizer step, then ``CausalLMModule.optimizer_step``'s ``zero_grad``; returns what the
    rank held in between, while the gradients exist (``memory_report`` plus the bytes of them that
    were alive at ``live``'s peak)."""
    module.objective.end_step([p.grad for p in module.model.parameters() if p.grad is not None], CPU, None)
    optimizer.step()
    held = memory_report(module.model, [optimizer])
    grads = [_local(p.grad).untyped_storage() for p in module.model.parameters() if p.grad is not None]
    held["gradients_at_peak"] = live.alive_at_peak(grads) if live is not None else held["gradients"]
    optimizer.zero_grad(set_to_none=True)
    return held


class _TrainingStep:
    """One step in the module's order under Lightning's automatic optimization (the forward and the
    objective's loss as ``training_step`` computes them, backward, the objective's end of step, the
    optimizer step, then ``optimizer_step``'s ``zero_grad``; gradient clipping's few scalars are
    left out)."""

    live: Optional["_LiveBytes"] = None  # set for the measured step

    def __init__(self, module, optimizer, loss_parallel_enabled: bool) -> None:
        self.module, self.optimizer = module, optimizer
        self.context = loss_parallel if loss_parallel_enabled else nullcontext

    def __call__(self, batch: dict) -> None:
        with self.context():
            loss, _ = self.module.objective.loss(self.module._batch_input(batch), batch)
            loss.backward()
        del loss
        self.memory = _optimizer_step(self.module, self.optimizer, self.live)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class _LiveBytes(TorchDispatchMode):
    """The bytes of every live storage made by ``fake_mode``'s tensors (None: real tensors),
    and their maximum. Storages are added when an op returns them and dropped when they are
    freed; ``UntypedStorage.resize_`` (how FSDP allocates and frees unsharded parameters) is
    not an op, so it is patched while the mode is active.

    It declares itself an infrastructure mode: torch.compile refuses to trace under any other
    mode. Tensors of the compiler's own fake mode (tracing) are not counted. Higher-order operators
    (a compiled, checkpointed block's ``run_and_save_rng_state`` around its attention) run as they
    are, their outputs counted like an op's.
    """

    supports_higher_order_operators = True

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True

    def __init__(self, fake_mode) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.sizes: dict[int, int] = {}
        self.current = self.peak = 0
        self.paused = 0
        # Storages are numbered as they appear and the peak remembers the last number before
        # it: a storage alive now whose number is at most ``peak_at`` was alive at the peak.
        self.born: dict[int, int] = {}
        self.count = self.peak_at = 0

    def add_static(self, module, optimizer, frozen: Sequence[torch.Tensor] = ()) -> None:
        """Count what exists before the step: parameters, buffers, gradients, optimizer state, and
        ``frozen`` (a frozen reference model's tensors)."""
        tensors = [*module.parameters(), *module.buffers(), *frozen]
        tensors += [p.grad for p in module.parameters() if p.grad is not None]
        tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        for tensor in tensors:
            for stored in stored_tensors(_local(tensor)):  # (an NF4 weight: its parts)
                self._add(stored.untyped_storage())

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self.sizes or self.paused:
            return
        self.sizes[key] = size = storage.nbytes()
        self.count += 1
        self.born[key] = self.count
        weakref.finalize(storage, self._free, key)
        self._grow(size)

    def _grow(self, size: int) -> None:
        self.current += size
        if self.current > self.peak:
            self.peak, self.peak_at = self.current, self.count

    def alive_at_peak(self, storages) -> int:
        """Bytes of ``storages`` (all alive now) that were alive at the peak."""
        return sum(self.sizes[s._cdata] for s in storages
                   if s._cdata in self.sizes and self.born[s._cdata] <= self.peak_at)

    def _free(self, key: int) -> None:
        self.current -= self.sizes.pop(key, 0)

    def __enter__(self):
        original = self._resize = torch.UntypedStorage.resize_
        live = self

        def resize_(storage, size):
            before = storage.nbytes()
            result = original(storage, size)
            key = storage._cdata
            if key in live.sizes:
                live.sizes[key] = storage.nbytes()
                live._grow(storage.nbytes() - before)
            else:
                live._add(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        _LIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_ = self._resize
        _LIVE.remove(self)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                tensor = _local(tensor)
                if getattr(tensor, "fake_mode", None) is self.fake_mode and tensor.layout == torch.strided:
                    self._add(tensor.untyped_storage())
        return out


# -- compile ----------------------------------------------------------------------------------

_LIVE: list[_LiveBytes] = []  # the active _LiveBytes, for the compiled graphs' interpreter


def _unfused_ops() -> set:
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward", "embedding_dense_backward",
             "index_put", "index_put_", "scatter", "scatter_add", "scatter_reduce", "sort", "topk", "cumsum",
             "histc", "_grouped_mm", "nonzero"]
    return {getattr(aten, name) for name in names if hasattr(aten, name)}


_UNFUSED_NAMES = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention", "_c10d_functional")


def _unfused(node: fx.Node, ops: set) -> bool:
    if node.op != "call_function":
        return False
    packet = getattr(node.target, "overloadpacket", None)
    if packet is torch.ops.aten.scatter and _scatter_upon_constant(node):
        return False
    return packet in ops or any(name in str(node.target) for name in _UNFUSED_NAMES)


def _scatter_upon_constant(node: fx.Node) -> bool:
    """A scalar scattered into a freshly filled tensor (the one-hot of cross entropy's
    backward): inductor lowers it to a pointwise select (``optimize_scatter_upon_const_tensor``)."""
    base = node.args[0] if node.args else None
    return (node.target is torch.ops.aten.scatter.value and isinstance(base, fx.Node)
            and getattr(base.target, "overloadpacket", None) in (torch.ops.aten.full, torch.ops.aten.zeros))


def materialized_nodes(graph: fx.Graph) -> set:
    """The nodes whose outputs take memory once inductor has fused the graph: its inputs and
    outputs, and the inputs and outputs of the ops it calls as kernels of their own (through
    views and tuple items to the tensor that owns the storage)."""
    ops, keep = _unfused_ops(), set()
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            keep.add(node)
        elif node.op == "output" or _unfused(node, ops):
            keep.add(node)
            keep.update(node.all_input_nodes)
    for node in reversed(graph.nodes):
        target = node.target
        owner = node.op == "call_function" and (getattr(target, "is_view", False) or getattr(target, "__name__", "") == "getitem")
        if node in keep and owner and node.args and isinstance(node.args[0], fx.Node):
            keep.add(node.args[0])
    return keep


class _FusedRun(fx.Interpreter):
    """Runs a graph op by op, leaving the fused-away outputs uncounted (freed at last use)."""

    def __init__(self, gm: fx.GraphModule, keep: set) -> None:
        super().__init__(gm)
        self.keep = keep

    def run_node(self, node: fx.Node) -> Any:
        live = _LIVE[-1] if _LIVE else None
        if live is None or node in self.keep:
            return super().run_node(node)
        live.paused += 1
        try:
            return super().run_node(node)
        finally:
            live.paused -= 1


def _graph_compiler(gm: fx.GraphModule, example_inputs) -> Any:
    keep = materialized_nodes(gm.graph)

    def run(args: list) -> Any:
        inputs = list(args)
        args.clear()  # boxed: the graph owns its inputs and frees each after its last use
        return _FusedRun(gm, keep).run(*inputs)

    run._boxed_call = True
    return run


def _estimate_backend(gm: fx.GraphModule, example_inputs) -> Any:
    aot_autograd, min_cut_rematerialization_partition, decompositions = estimate_backend_parts()
    backend = aot_autograd(fw_compiler=_graph_compiler, bw_compiler=_graph_compiler,
                           partition_fn=min_cut_rematerialization_partition, decompositions=decompositions)
    return backend(gm, example_inputs)


def _register_backend() -> None:
    if COMPILE_BACKEND not in list_backends(exclude_tags=()):
        register_backend(name=COMPILE_BACKEND, compiler_fn=_estimate_backend)


_register_backend()
