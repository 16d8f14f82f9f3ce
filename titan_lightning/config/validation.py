"""Every rule a run's configuration must pass. Single-field rules live in each class's __post_init__.

Each runs once per launch: a strategy's own degrees (``validate_degrees``) when the Trainer is
built, before any process is spawned; the job (``validate_job``), the strategy against it
(``validate_strategy``) and the module's tensor-parallel plan (``validate_tp_plan``) in the
strategy's ``check_module``, which ``build_trainer`` calls (a Trainer built by hand: at
``setup_environment``); what the module itself must declare is parallel/contracts.py's. A model
family's own rules stay with the family: ``validate_job`` calls them through the job's declared
hook, ``JobConfig.check_family``. ``validate_job`` remembers the jobs it passed: asked again about the same
object, unchanged and for the same launch, it returns at once. Every message names the fields,
their values and what would be valid.
"""

import csv
import os
import re
import warnings
import weakref
from typing import Optional, Sequence

from titan_lightning.config.job import CP_ATTENTIONS, JobConfig
from titan_lightning.config.parallelism import LOOPED_PP_SCHEDULES, V_PP_SCHEDULES, ParallelismConfig
from titan_lightning.config.training import TrainingConfig


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line."""


class SizesError(ConfigError, RuntimeError):
    """ModelParallelStrategy's sizes that do not multiply to the world size (Lightning's strategy
    raises RuntimeError for them; code written for it may catch that)."""


# id(job) -> (the job, weakly; what it passed for): the jobs validate_job has passed.
_PASSED: dict[int, tuple[weakref.ref, tuple]] = {}


def validate_job(job: JobConfig, *, world_size: int, max_steps: Optional[int] = None, fake_pg: bool = False,
                 device_type: Optional[str] = None) -> None:
    """Every rule of a run's job, for a launch on ``world_size`` ranks (the schedule too given
    ``max_steps``, the kernels given ``device_type``). Once per launch: this same object, unchanged
    since it passed with these arguments, is not checked again."""
    launch = (world_size, max_steps, fake_pg, device_type)
    known = _PASSED.get(id(job))
    if known is not None and known[0]() is job and known[1] == (*launch, repr(job)):
        return
    _check_job(job, world_size=world_size, max_steps=max_steps, fake_pg=fake_pg, device_type=device_type)
    key = id(job)  # (__post_init__ may have normalized a field: the job as it passed)
    _PASSED[key] = (weakref.ref(job, lambda _: _PASSED.pop(key, None)), (*launch, repr(job)))


def _check_job(job: JobConfig, *, world_size: int, max_steps: Optional[int], fake_pg: bool,
               device_type: Optional[str]) -> None:
    # A job whose fields were assigned after construction skipped __post_init__: run it again.
    for section in (job.model, job.training, job.parallelism, job.optimizer, job.lr_schedule, job.data,
                    job.activation_checkpoint, job.checkpoint, job.compile, job.quantize, job.profiling,
                    job.preference):
        section.__post_init__()
    validate_degrees(job.parallelism, world_size, fake_pg=fake_pg)
    validate_model_parallelism(job)
    validate_batch(job, world_size)
    validate_sft(job)
    validate_preference(job, world_size)
    if max_steps is not None:
        validate_schedule(job, max_steps)
    if device_type is not None:
        validate_attention_kernel(job, device_type)
        validate_gpu(job, device_type)
        validate_sliding_kernel(job)
        validate_float8_device(job, device_type, fake_pg=fake_pg)
    job.check_family()


def validate_degrees(p: ParallelismConfig, world_size: int, *, fake_pg: bool = False) -> None:
    """Degrees against the world size (under the fake process group with ``fake_pg``); needs
    nothing but the parallelism section."""
    if fake_pg and p.pp > 1:
        raise ConfigError(f"parallelism.pp={p.pp}: pipeline parallelism cannot run under the fake process group")
    fixed = p.fixed_degrees
    if p.dp_shard == -1:
        if world_size % fixed:
            raise ConfigError(
                f"world size {world_size} is not divisible by dp_replicate*tp*pp*cp = "
                f"{p.dp_replicate}*{p.tp}*{p.pp}*{p.cp} = {fixed}; "
                f"set parallelism degrees whose product divides the world size"
            )
    elif fixed * p.dp_shard != world_size:
        raise ConfigError(
            f"parallelism degrees dp_replicate*dp_shard*tp*pp*cp = "
            f"{p.dp_replicate}*{p.dp_shard}*{p.tp}*{p.pp}*{p.cp} = {fixed * p.dp_shard} "
            f"must equal the world size {world_size}; set parallelism.dp_shard=-1 to use the rest"
        )
    dp_shard = p.resolved_dp_shard(world_size)
    sparse = dp_shard * p.cp * p.tp
    if sparse % p.ep:
        raise ConfigError(
            f"parallelism.ep={p.ep} must divide dp_shard*cp*tp = {dp_shard}*{p.cp}*{p.tp} = {sparse}"
        )
    if p.dp_replicate > 1 and dp_shard * p.cp == 1:  # DDP: replicated, nothing sharded
        if p.ep > 1:
            raise ConfigError(
                f"parallelism.ep={p.ep} with dp_replicate={p.dp_replicate} and no FSDP (dp_shard*cp = 1) is not "
                f"supported: replicate the experts with HSDP instead (dp_shard > 1)"
            )
        if p.pp > 1:
            raise ConfigError(
                f"parallelism.pp={p.pp} with dp_replicate={p.dp_replicate} and no FSDP (dp_shard*cp = 1) is not "
                f"supported: use HSDP (dp_shard > 1) or FSDP with pipeline parallelism"
            )
    validate_pipeline_degrees(p)


def validate_pipeline_degrees(p: ParallelismConfig) -> None:
    """Schedule, stages per rank and microbatches agree (what needs only the parallelism section)."""
    if p.pp == 1:
        return
    looped = p.pp_schedule in LOOPED_PP_SCHEDULES
    spr = p.stages_per_rank
    if p.pp_schedule_csv is not None:
        validate_schedule_csv(p)
    elif looped and spr < 2:
        raise ConfigError(
            f"parallelism.pp_schedule={p.pp_schedule!r} is a looped schedule and needs several stages per rank, "
            f"but parallelism.pp_stages_per_rank={spr}; set it to 2 or more, or use GPipe or 1F1B"
        )
    elif not looped and spr != 1:
        raise ConfigError(
            f"parallelism.pp_schedule={p.pp_schedule!r} runs one stage per rank, but parallelism.pp_stages_per_rank="
            f"{spr}; use a looped schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) for {spr}"
        )
    if p.pp_schedule in V_PP_SCHEDULES and spr != 2:
        raise ConfigError(
            f"parallelism.pp_schedule={p.pp_schedule!r} places 2 stages per rank in a V; "
            f"parallelism.pp_stages_per_rank={spr} must be 2"
        )
    if p.pp_stage_modules is not None and len(p.pp_stage_modules) != p.num_stages:
        raise ConfigError(
            f"parallelism.pp_stage_modules lists {len(p.pp_stage_modules)} stages, but pp={p.pp} x "
            f"{spr} stages per rank = {p.num_stages}"
        )
    if p.pp_schedule == "1F1B" and p.pp_microbatches < p.pp:
        raise ConfigError(
            f"parallelism.pp_microbatches={p.pp_microbatches} must be >= parallelism.pp={p.pp} for the 1F1B "
            f"schedule (torch requires a microbatch per stage); use more microbatches or GPipe"
        )
    if looped and p.pp_microbatches < p.pp:
        raise ConfigError(
            f"parallelism.pp_microbatches={p.pp_microbatches} must be >= parallelism.pp={p.pp} "
            f"for the looped schedule {p.pp_schedule}"
        )
    if p.pp_schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, p.pp_microbatches // p.pp)
        if p.pp_microbatches % rounds:
            raise ConfigError(
                f"parallelism.pp_microbatches={p.pp_microbatches} must be a multiple of the {rounds} rounds "
                f"(microbatches // pp) of {p.pp_schedule} with pp={p.pp}"
            )
    if p.pp_microbatches < p.num_stages:
        warnings.warn(
            f"parallelism.pp_microbatches={p.pp_microbatches} is fewer than the {p.num_stages} pipeline stages "
            f"(pp={p.pp} x {spr} per rank): the pipeline idles most of each step; use at least {p.num_stages}",
            stacklevel=3,
        )


def validate_schedule_csv(p: ParallelismConfig) -> None:
    """A schedule CSV (torch's compute-only format): one row per pipeline rank, each cell an
    action ``<stage><F|B|I|W><microbatch>`` within this run's stages and microbatches."""
    field = f"parallelism.pp_schedule_csv={p.pp_schedule_csv!r}"
    if not os.path.isfile(p.pp_schedule_csv):
        raise ConfigError(f"{field} is not a file")
    try:
        with open(p.pp_schedule_csv, newline="", encoding="utf-8") as f:
            rows = [row for row in csv.reader(f) if any(cell.strip() for cell in row)]
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise ConfigError(f"{field} cannot be read as CSV ({err})") from None
    if len(rows) != p.pp:
        raise ConfigError(f"{field} has {len(rows)} rows; it needs one per pipeline rank (parallelism.pp={p.pp})")
    for rank, row in enumerate(rows):
        for column, cell in enumerate(row, start=1):
            if not cell.strip():
                continue
            action = re.fullmatch(r"(\d+)([FBIW])(\d+)", cell.strip())
            if action is None:
                raise ConfigError(f"{field}, row {rank + 1}, column {column}: {cell!r} is not an action like 0F1 "
                                  f"(stage, F/B/I/W, microbatch)")
            if int(action[1]) >= p.num_stages or int(action[3]) >= p.pp_microbatches:
                raise ConfigError(f"{field}, row {rank + 1}, column {column}: {cell!r} names a stage or microbatch "
                                  f"outside {p.num_stages} stages x parallelism.pp_microbatches={p.pp_microbatches}")


def validate_model_parallelism(job: JobConfig) -> None:
    p, m = job.parallelism, job.model
    for name in ("n_heads", "n_kv_heads"):
        heads = getattr(m, name)
        if heads % p.tp:
            raise ConfigError(f"model.{name}={heads} must be divisible by parallelism.tp={p.tp}")
    if m.vocab_size % p.tp:
        raise ConfigError(f"model.vocab_size={m.vocab_size} must be divisible by parallelism.tp={p.tp}")
    seq_len = job.training.seq_len
    max_seq_len = getattr(m, "max_seq_len", None)
    if max_seq_len is not None and seq_len > max_seq_len:
        raise ConfigError(f"training.seq_len={seq_len} must be <= model.max_seq_len={max_seq_len}")
    validate_context_parallel(job)
    validate_layer_types(job)
    validate_expert_parallel(job)
    validate_pipeline(job)


def validate_pipeline(job: JobConfig) -> None:
    """Stages against the model's layers, microbatches against the local batch."""
    p = job.parallelism
    if p.pp == 1:
        return
    n_layers = getattr(job.model, "n_layers", None)
    if n_layers is not None:
        validate_stage_count(p, n_layers)
    batch = job.training.microbatch_size
    if batch % p.pp_microbatches:
        raise ConfigError(
            f"parallelism.pp_microbatches={p.pp_microbatches} must divide the local batch of {batch} sequences "
            f"(training.tokens_per_microbatch_per_dp_rank={job.training.tokens_per_microbatch_per_dp_rank} / "
            f"seq_len={job.training.seq_len})"
        )


def validate_stage_count(p: ParallelismConfig, n_layers: int, layers: str = "model.n_layers") -> None:
    """No more pipeline stages than the model has blocks (``layers``: what counted them)."""
    if p.num_stages > n_layers:
        raise ConfigError(
            f"parallelism.pp={p.pp} x {p.stages_per_rank} stages per rank = {p.num_stages} stages is more than "
            f"{layers}={n_layers}; use fewer stages"
        )


def validate_expert_parallel(job: JobConfig) -> None:
    """EP needs MoE layers whose experts split evenly; MoE under TP needs sequence parallelism,
    and with ep=1 (tensor-parallel experts) a hidden dim that splits over tp."""
    p, moe = job.parallelism, getattr(job.model, "moe", None)
    if moe is None:
        if p.ep > 1:
            raise ConfigError(f"parallelism.ep={p.ep} needs a mixture-of-experts model, and model.moe is None")
        return
    if p.tp > 1 and not p.sequence_parallel:
        raise ConfigError(
            f"MoE layers with parallelism.tp={p.tp} need parallelism.sequence_parallel=True: without it every "
            f"TP rank routes the same tokens and the experts' gradients count each token {p.tp} times"
        )
    validate_expert_split("model.moe", moe.num_experts, getattr(moe, "hidden_dim", None), ep=p.ep, tp=p.tp)


def validate_expert_split(owner: str, num_experts: int, hidden_dim: Optional[int], *, ep: int, tp: int) -> None:
    """The routed experts split over the degrees: ``ep`` divides their number; with ``tp`` > 1 and
    ep = 1 (expert tensor parallelism) ``tp`` divides their hidden dim. Before launch from the job's
    ``model.moe``; when parallel/expert.py shards a model built at setup, from its experts (``owner``)."""
    if num_experts % ep:
        raise ConfigError(f"parallelism.ep={ep} must divide {owner}.num_experts={num_experts}")
    if tp > 1 and ep == 1 and hidden_dim is not None and hidden_dim % tp:
        raise ConfigError(
            f"parallelism.tp={tp} with ep=1 splits the experts' hidden dim: {owner}.hidden_dim={hidden_dim} "
            f"must be divisible by {tp}"
        )


def validate_context_parallel(job: JobConfig) -> None:
    """CP degree, the model's attention and the sequence length agree."""
    p, m, seq_len = job.parallelism, job.model, job.training.seq_len
    attention = getattr(m, "attention", "sdpa")
    if p.cp > 1 and attention not in CP_ATTENTIONS:
        raise ConfigError(
            f"parallelism.cp={p.cp} needs a context-parallel attention, but model.attention={attention!r} "
            f"cannot do CP; apply ContextParallelTransform(attention=...) with one of {', '.join(CP_ATTENTIONS)}"
        )
    if p.cp == 1 and attention in CP_ATTENTIONS:
        raise ConfigError(
            f"model.attention={attention!r} is a context-parallel attention but parallelism.cp=1; "
            f"set parallelism.cp > 1 or model.attention='sdpa'"
        )
    if p.cp > 1 and p.cp_load_balancer == "ptrr":
        raise ConfigError(
            "parallelism.cp_load_balancer='ptrr' balances block-masked (flex) attention, which these "
            "attentions do not use; use 'headtail' (causal) or None"
        )
    if attention == "ulysses":
        for name in ("n_heads", "n_kv_heads"):
            heads = getattr(m, name)
            if heads % (p.tp * p.cp):
                raise ConfigError(
                    f"model.attention='ulysses' shards heads over tp*cp: model.{name}={heads} must be divisible "
                    f"by parallelism.tp*cp = {p.tp}*{p.cp} = {p.tp * p.cp}; use allgather or ring attention instead"
                )
    divisor = p.seq_len_divisor
    if seq_len % divisor:
        cp_part = divisor // (p.tp if p.sequence_parallel and p.tp > 1 else 1)
        balancer = " (2*cp with the headtail load balancer)" if cp_part == 2 * p.cp and p.cp > 1 else ""
        raise ConfigError(
            f"training.seq_len={seq_len} must be divisible by {divisor}: {cp_part} for cp={p.cp}{balancer}, "
            f"times tp={p.tp} with sequence_parallel={p.sequence_parallel}"
        )


def validate_layer_types(job: JobConfig) -> None:
    """``model.layer_types`` names every layer, and its sliding layers have a window."""
    m = job.model
    types, n_layers = getattr(m, "layer_types", None), getattr(m, "n_layers", None)
    if types is None:
        return
    if n_layers is not None and len(types) != n_layers:
        raise ConfigError(f"model.layer_types lists {len(types)} layers, but model.n_layers={n_layers}: "
                          f"name each layer's attention ('full_attention' or 'sliding_attention')")
    if "sliding_attention" in types and getattr(m, "sliding_window", None) is None:
        raise ConfigError("model.layer_types has 'sliding_attention' layers but model.sliding_window=None: "
                          "set the window (in tokens), or make every layer 'full_attention'")


def validate_sliding_kernel(job: JobConfig) -> None:
    """A sliding window on varlen needs ``varlen_attn``'s ``window_size`` (torch 2.13 has it)."""
    m = job.model
    if getattr(m, "attention", "sdpa") != "varlen" or getattr(m, "sliding_window", None) is None:
        return
    import inspect

    import torch
    from torch.nn.attention.varlen import varlen_attn

    if "window_size" not in inspect.signature(varlen_attn).parameters:
        raise ConfigError(f"model.sliding_window={m.sliding_window} with model.attention='varlen' needs "
                          f"varlen_attn's window_size, which torch {torch.__version__} lacks: use 'flex' or 'sdpa'")


def validate_sft(job: JobConfig) -> None:
    """SFT data packed several conversations to a window: attention and positions must keep them apart."""
    data, m = job.data, job.model
    if not data.sft:
        return
    mask, positions = getattr(m, "mask", "causal"), getattr(m, "positions", "global")
    if data.sft_packing in ("packed", "best_fit") and (mask != "block_causal" or positions != "per_document"):
        raise ConfigError(
            f"data.sft=True packs several conversations into each window, which needs document masking: "
            f"model.mask={mask!r} and model.positions={positions!r} must be 'block_causal' and 'per_document' "
            f"(--job.model.mask block_causal --job.model.positions per_document), or set data.sft_packing='padded'"
        )
    if data.repeat_to_fit:
        raise ConfigError("data.repeat_to_fit=True with data.sft=True: SFT windows hold whole conversations and "
                          "are never repeated to fill one; set data.repeat_to_fit false")


def validate_preference(job: JobConfig, world_size: int = 1) -> None:
    """Preference training reads masked pairs packed whole, on the layouts its per-sequence sums support."""
    pref, data, p = job.preference, job.data, job.parallelism
    if not pref.enabled:
        return
    loss = f"preference.loss={pref.loss!r}"
    if not data.sft:
        raise ConfigError(f"{loss} trains on the loss masks of pairs (titan-lightning prepare --preference): set "
                          f"data.sft true")
    if data.sft_packing == "padded":
        raise ConfigError(f"{loss} packs each pair whole into a window: data.sft_packing='padded' is for "
                          f"conversations; use 'best_fit' or 'packed'")
    if p.pp > 1 and pref.needs_reference and pref.reference != "precomputed":
        raise ConfigError(f"preference.reference={pref.reference!r} with parallelism.pp={p.pp}: that reference's "
                          f"forward runs inside the last stage's loss, where the other stages are not; use "
                          f"'precomputed' (the reference from the starting weights, one pass before training)")
    if pref.needs_reference and pref.reference == "frozen" and job.lora.enabled and job.lora.quantize_base == "nf4":
        raise ConfigError("preference.reference='frozen' with lora.quantize_base='nf4' would keep a second NF4 base "
                          "of the same weights: use 'adapters_off' (the base with the adapters switched off, which is "
                          "the starting model) or 'precomputed'")
    if pref.needs_reference and pref.reference == "adapters_off" and not job.lora.enabled:
        raise ConfigError(f"preference.reference='adapters_off' is the model with its LoRA adapters switched off, "
                          f"and lora.rank=0 adds none: set lora.rank (or preference.reference 'precomputed')")


def validate_attention_kernel(job: JobConfig, device_type: str) -> None:
    """The attention kernel runs, and trains, on the run's device with this torch."""
    kernel = getattr(job.model, "attention", "sdpa")
    if kernel == "varlen":
        import importlib.util

        import torch

        if importlib.util.find_spec("torch.nn.attention.varlen") is None:
            raise ConfigError(f"model.attention='varlen' needs torch.nn.attention.varlen (in torch 2.11 and 2.13), which "
                              f"torch {torch.__version__} lacks: use 'flex' or 'sdpa'")
        if device_type != "cuda":
            raise ConfigError(f"model.attention='varlen' runs FlashAttention on CUDA only, and this run is on "
                              f"{device_type!r}: use 'sdpa' (block_causal through a dense mask)")
    if kernel == "flex" and device_type == "cpu":
        raise ConfigError("model.attention='flex' cannot train on 'cpu': torch has no FlexAttention backward there; "
                          "use 'sdpa' (block_causal through a dense mask) or a GPU")
    if kernel == "varlen" and job.training.mixed_precision_param == "float32":
        raise ConfigError("model.attention='varlen' runs FlashAttention in bf16 only, and "
                          "training.mixed_precision_param='float32' computes in fp32: add --trainer.precision "
                          "bf16-mixed, or use model.attention 'flex' or 'sdpa'")


def validate_gpu(job: JobConfig, device_type: str, capability: Optional[tuple[int, int]] = None,
                 triton: Optional[bool] = None) -> None:
    """bf16 and compiled kernels on a GPU of compute ``capability`` (default: the current CUDA
    device's) with ``triton`` installed or not (default: whether it is)."""
    t, c = job.training, job.compile
    bf16 = "bfloat16" in (t.dtype, t.mixed_precision_param)
    inductor = c.enable and c.backend == "inductor"
    if device_type != "cuda" or not (bf16 or inductor):
        return
    if capability is None:
        import torch

        capability = torch.cuda.get_device_capability()
    if triton is None:
        import importlib.util

        triton = importlib.util.find_spec("triton") is not None
    if bf16 and tuple(capability) < (8, 0):
        field = "training.dtype" if t.dtype == "bfloat16" else "training.mixed_precision_param"
        raise ConfigError(f"{field}='bfloat16' needs a GPU with bf16 (compute capability 8.0 or newer), this one is "
                          f"{capability[0]}.{capability[1]}: use --trainer.precision 32-true")
    if inductor and (not triton or tuple(capability) < (7, 0)):
        why = "triton is not installed" if not triton else f"this GPU is {capability[0]}.{capability[1]}"
        raise ConfigError(f"compile.enable=True with compile.backend='inductor' makes Triton kernels, which need "
                          f"triton and a GPU of compute capability 7.0 or newer, and {why}: set --job.compile.enable "
                          f"false")


def validate_float8_device(job: JobConfig, device_type: str, capability: Optional[tuple[int, int]] = None, *,
                           fake_pg: bool = False) -> None:
    """Float8 linears on the run's device: float8 kernels on a GPU of compute ``capability`` 8.9 or
    newer (default: the current CUDA device's), compiled (inductor fuses torchao's casts); anywhere
    else only torchao's emulation."""
    f8, compile, p = job.quantize.float8, job.compile, job.parallelism
    if f8.enable and not f8.emulate and device_type == "cuda" and capability is None:
        import torch

        capability = torch.cuda.get_device_capability()
    if not f8.enable or f8.emulate:
        if f8.enable and device_type == "cpu" and f8.enable_fsdp_float8_all_gather and not fake_pg:
            raise ConfigError(
                "quantize.float8.enable_fsdp_float8_all_gather=True cannot run on CPU: gloo has no float8 "
                "all-gather (\"Invalid scalar type\"); set it False there (FSDP then all-gathers high precision)"
            )
        if device_type == "cpu" and f8.float8_tensor_parallel and p.tp > 1 and p.sequence_parallel and not fake_pg:
            raise ConfigError(
                f"quantize.float8.recipe='tensorwise' with parallelism.tp={p.tp} and "
                f"parallelism.sequence_parallel=True cannot run on CPU: torchao's float8 TP styles all-gather the "
                f"sequence in float8 and gloo has no float8 all-gather; set parallelism.sequence_parallel=False "
                f"there (or quantize.float8.recipe='rowwise')"
            )
        return
    if device_type != "cuda":
        raise ConfigError(
            f"quantize.float8.enable=True on {device_type!r} needs quantize.float8.emulate=True: float8 kernels "
            f"run on CUDA GPUs of compute capability 8.9 or newer only"
        )
    if capability is not None and tuple(capability) < (8, 9):
        raise ConfigError(
            f"quantize.float8.enable=True needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell), "
            f"this one is {capability[0]}.{capability[1]}; turn float8 off (or quantize.float8.emulate=True to test)"
        )
    if not (compile.enable and "model" in compile.components):
        raise ConfigError(
            f"quantize.float8.enable=True on a GPU needs compile.enable=True with 'model' in compile.components "
            f"(got enable={compile.enable}, components={compile.components}): eager float8 casts are slower than bf16"
        )


def validate_batch(job: JobConfig, world_size: int) -> None:
    t = job.training
    if t.tokens_per_step is None:
        return
    dp = _dp_degree(job.parallelism, world_size)
    per_step_unit = t.tokens_per_microbatch_per_dp_rank * dp
    if t.tokens_per_step % per_step_unit:
        raise ConfigError(
            f"training.tokens_per_step={t.tokens_per_step} must be a multiple of "
            f"training.tokens_per_microbatch_per_dp_rank * data-parallel degree = "
            f"{t.tokens_per_microbatch_per_dp_rank} * {dp} = {per_step_unit}"
        )


def _dp_degree(p: ParallelismConfig, world_size: int) -> int:
    return p.dp_replicate * p.resolved_dp_shard(world_size)


def gradient_accumulation_steps(job: JobConfig, world_size: int) -> int:
    """Microbatches per optimizer step on each data-parallel rank."""
    t = job.training
    if t.tokens_per_step is None:
        return 1
    dp = _dp_degree(job.parallelism, world_size)
    return t.tokens_per_step // (t.tokens_per_microbatch_per_dp_rank * dp)


def validate_schedule(job: JobConfig, max_steps: int) -> None:
    """The schedule is defined in steps; a too-long warmup is shortened (see optim.wsd_lambda).
    ``max_steps`` -1 (Lightning's unset) is a run by epochs: the data module derives the steps
    from the data at setup, and a mixture of data.sources has no epochs."""
    if max_steps == -1 and job.data.sources:
        raise ConfigError("trainer.max_steps=-1 runs by epochs, and a mixture of data.sources is a weighted stream "
                          "with no epochs; set trainer.max_steps")
    if max_steps < 1 and max_steps != -1:
        raise ConfigError(f"trainer.max_steps={max_steps} must be >= 1, or -1 to run trainer.max_epochs over the data")


def validate_estimate(job: JobConfig, world_size: int, rank: int) -> None:
    """What the memory estimator models: pipeline stages with data parallelism only."""
    p = job.parallelism
    if p.pp > 1 and (p.tp > 1 or p.cp > 1 or p.ep > 1 or p.pp_schedule_csv is not None):
        raise ConfigError(
            f"parallelism.pp={p.pp} with tp={p.tp}, cp={p.cp}, ep={p.ep}"
            f"{', pp_schedule_csv' if p.pp_schedule_csv else ''}: the estimator models pipeline stages with "
            f"data parallelism (FSDP/HSDP/DDP) only; estimate the stages' layout with pp=1 or without the others"
        )
    if not 0 <= rank < world_size:
        raise ConfigError(f"--rank={rank} must be in [0, --world_size={world_size})")


# -- the Trainer's arguments and the data against the job ------------------------------------

# Trainer arguments a JobConfig owns: (the field to set instead, Trainer's default).
TRAINER_ARGS_SET_BY_JOB = {
    "gradient_clip_val": ("job.training.max_grad_norm", None),
    "deterministic": ("job.training.deterministic", None),
    "accumulate_grad_batches": ("job.training.tokens_per_step", 1),
}

# Lightning's precision flag -> (training.dtype, training.mixed_precision_param). The strategy
# applies it (FSDP's mixed-precision policy, or autocast on one device); Lightning's own
# precision plugin stays at 32-true so that nothing autocasts twice.
LIGHTNING_PRECISIONS = {
    "32-true": ("float32", "float32"), "32": ("float32", "float32"), 32: ("float32", "float32"),
    "bf16-mixed": ("float32", "bfloat16"), "bf16-true": ("bfloat16", "bfloat16"),
}


def validate_trainer_args(trainer: dict) -> None:
    """A run with a job leaves the Trainer arguments the job owns at their defaults."""
    for key, (instead, default) in TRAINER_ARGS_SET_BY_JOB.items():
        value = trainer.get(key, default)
        if value != default:
            raise ConfigError(f"trainer.{key}={value!r} is set by {instead}; set that instead")


def precision_dtypes(precision, training: TrainingConfig) -> tuple[str, str]:
    """(training.dtype, training.mixed_precision_param) for Lightning's ``trainer.precision``;
    refused when unsupported or when ``training`` sets other dtypes."""
    if precision not in LIGHTNING_PRECISIONS:
        raise ConfigError(
            f"trainer.precision={precision!r} is not supported; use one of 32-true, bf16-mixed, bf16-true "
            f"(or set training.dtype / training.mixed_precision_param)"
        )
    dtypes = LIGHTNING_PRECISIONS[precision]
    if (training.dtype, training.mixed_precision_param) not in (dtypes, ("float32", "float32")):
        raise ConfigError(
            f"trainer.precision={precision!r} disagrees with training.dtype={training.dtype!r}, "
            f"training.mixed_precision_param={training.mixed_precision_param!r}; set the precision in one place"
        )
    return dtypes


def apply_precision(precision, training: TrainingConfig) -> None:
    """Set ``training``'s dtypes from Lightning's ``trainer.precision`` (None: as they are), as a
    Trainer built for the run and the estimator of its memory both read them."""
    if precision is not None:
        training.dtype, training.mixed_precision_param = precision_dtypes(precision, training)


def validate_vocab(job: JobConfig, tokenizer_vocab_size: int) -> None:
    """The data's tokenizer produces only ids the model embeds."""
    if tokenizer_vocab_size > job.model.vocab_size:
        raise ConfigError(
            f"the data's tokenizer has {tokenizer_vocab_size} tokens, more than model.vocab_size="
            f"{job.model.vocab_size}; use a model vocab_size >= {tokenizer_vocab_size}"
        )


# -- a strategy and the module it runs --------------------------------------------------------


def validate_lightning_sizes(strategy: str, data_parallel, tensor_parallel, dp: int, tp: int, world_size: int) -> None:
    """ModelParallelStrategy's ``data_parallel_size`` and ``tensor_parallel_size`` (``dp``, ``tp``
    once "auto" is resolved) cover the world."""
    if dp * tp != world_size:
        raise SizesError(
            f"{strategy}(data_parallel_size={data_parallel!r}, tensor_parallel_size={tensor_parallel!r}): "
            f"{dp} * {tp} = {dp * tp}; the sizes multiplied should equal the world size {world_size} (num_nodes * "
            f"devices)"
        )


def validate_strategy(strategy: str, scope: Sequence[str], p: ParallelismConfig,
                      given: Optional[ParallelismConfig] = None) -> None:
    """A strategy applies every degree of ``p`` above 1 (``scope``: those it applies); degrees it
    was ``given`` besides a module's job agree with the job's, ``p``."""
    # A default-constructed config is what class-path parsers pass for "not given".
    if given is not None and given != ParallelismConfig() and given != p:
        raise ConfigError(
            f"{strategy} was given degrees {given} but the module's job.parallelism is {p}; "
            f"set the degrees in one place (the job)"
        )
    for name in ("dp_replicate", "tp", "cp", "pp", "ep"):
        if name not in scope and getattr(p, name) > 1:
            raise ConfigError(f"{strategy} does not apply parallelism.{name}={getattr(p, name)}; "
                              f"use TitanStrategy to combine parallelisms")


def validate_tp_plan(module: str, p: ParallelismConfig, world_size: int, plan: Optional[dict], fused: str) -> None:
    """A module under TP declares a plan, and FSDP composes with it: no ``fused`` style entries."""
    if not plan:
        raise ConfigError(
            f"parallelism.tp={p.tp} needs a tensor-parallel plan, and {module} declares none: give it a `tp_plan` "
            f"attribute mapping module names (relative to the LightningModule, '*' for layer indices) to styles "
            f"such as 'colwise' and 'rowwise' (see titan_lightning/parallel/tensor.py)"
        )
    entries = sorted(name for name, style in plan.items() if str(style).startswith(fused))
    shards = p.resolved_dp_shard(world_size) * p.cp
    if entries and shards > 1:
        # FSDP over a _StridedShard computes its split as if TP's shard were one block: training is
        # right, but the placements no longer say which rows a rank holds (checkpoints would store
        # them out of order).
        raise ConfigError(
            f"tp_plan entries {entries} ({fused}) do not compose with FSDP (parallelism.dp_shard*cp={shards}): "
            f"with data parallelism, store the projection's rows per head group ([q_g; k_g; v_g] for each group g, "
            f"as GPT-NeoX) and use 'colwise_grouped', or shard only the MLP"
        )


