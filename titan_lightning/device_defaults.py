"""Speed settings chosen for the device a run gets, for the runs whose recipe asks for them
(``for_device(run, estimate)``: recipes.hf:sft and recipes.hf:pretrained). ``build_trainer``
applies the choice once, when the Trainer knows the device and before the job is validated.

The family presets (recipes.llama3:llama3_8b, ...) do not ask: they are the published
configurations the benchmarks compare at fixed settings; the debug recipes are CPU runs with goldens.

On a CUDA GPU:
  - bf16 mixed precision (fp32 parameters, bf16 compute) where the GPU has bf16 (8.0+); fp32 where
    it has none;
  - compiled blocks (``compile.enable``) where inductor makes kernels (triton, 7.0+);
  - the fastest attention kernel that is exact for the mask: causal: ``sdpa`` (flash or cuDNN);
    ``block_causal`` or a sliding window: ``varlen`` (FlashAttention over the documents), else
    ``flex`` where varlen cannot (fp32, a torch without it or without its window, a model that
    refuses it: gpt-oss's sinks);
  - the window (``training.seq_len``: up to SEQ_LEN, within the model's positions), the tokens per
    microbatch (up to TOKENS_PER_MICROBATCH) and the activation checkpointing whose peak, by the
    memory estimator (estimate.py), stays under MEMORY_FRACTION of the device's memory: two or
    three estimates, the batch in between interpolated (activations grow with it linearly).
On every other device nothing changes. One line on the ``titan_lightning`` logger says what was
chosen and why.

A field the user set is kept: one the command line names (``--job.training.seq_len 2048``,
``--trainer.precision 32-true``), one the ``--config`` file or the user's own recipe code sets
to another value than the shipped recipe did, or one a ``--print_config`` file lists on its
``# explicit:`` line (written there when the command line named it).
"""

import copy
import gc
import dataclasses
import importlib.util
import inspect
import logging
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional

import torch

from titan_lightning.config import ConfigError, JobConfig, validate_job
from titan_lightning.config.job import KERNEL_ATTENTIONS

log = logging.getLogger(__name__)
GiB = 2**30

PRECISION = ("training.dtype", "training.mixed_precision_param")
# The job fields the choice sets (dotted as on the command line, without "job.").
FIELDS = (*PRECISION, "compile.enable", "model.attention", "training.seq_len",
          "training.tokens_per_microbatch_per_dp_rank", "activation_checkpoint.mode")
SIZES = ("training.seq_len", "training.tokens_per_microbatch_per_dp_rank", "activation_checkpoint.mode")
SEQ_LEN = 4096  # the longest window chosen (never beyond the model's positions, never below the recipe's)
TOKENS_PER_MICROBATCH = 16384  # per data-parallel rank: 51.7% MFU on a Qwen 2.5 1.5B shape, one H200
MEMORY_FRACTION = 0.85  # of the device's memory the estimated peak may take (CUDA context, NCCL, fragments)
EXPLICIT_LINE = "# explicit: "  # --print_config's record of the fields the command line named


@dataclass(frozen=True, kw_only=True)
class Device:
    """What the choice reads of the run's device (``Device.of`` fills it from torch)."""

    type: str  # "cpu", "cuda", ...
    name: str = ""
    memory: int = 0  # bytes
    bf16: bool = False  # bf16 kernels (compute capability 8.0+)
    compiles: bool = False  # inductor's Triton kernels (triton installed, capability 7.0+)
    varlen: bool = False  # torch.nn.attention.varlen (FlashAttention over variable lengths)
    varlen_window: bool = False  # ... with a sliding window (window_size)
    world_size: int = 1

    @classmethod
    def of(cls, device: Any, world_size: int) -> "Device":
        if device.type != "cuda":
            return cls(type=device.type, world_size=world_size)
        props = torch.cuda.get_device_properties(device)
        capability = (props.major, props.minor)
        varlen = importlib.util.find_spec("torch.nn.attention.varlen") is not None
        window = False
        if varlen:
            from torch.nn.attention.varlen import varlen_attn

            window = "window_size" in inspect.signature(varlen_attn).parameters
        return cls(type="cuda", name=props.name, memory=props.total_memory, bf16=capability >= (8, 0),
                   compiles=capability >= (7, 0) and importlib.util.find_spec("triton") is not None,
                   varlen=varlen, varlen_window=window, world_size=world_size)


@dataclass(frozen=True)
class Choice:
    job: JobConfig  # the job with the choice applied (explicit fields as they were)
    line: Optional[str]  # what was chosen and why; None where nothing is chosen (not a GPU)


@dataclass(frozen=True)
class ForDevice:
    """A run's leave to its device to choose: the job as the recipe set it, and the estimator that
    sizes the choice (``titan_lightning.estimate.estimate``: the recipe imports it, so that only runs
    that choose load it)."""

    recipe: JobConfig
    estimate: Callable


def for_device(run, estimate: Callable):
    """Let the device ``run`` gets choose its speed settings at launch (``build_trainer``), sized by
    ``estimate``; the run's job as it is now is the recipe's (fields that differ from it at launch
    are the user's)."""
    run.device_choice = ForDevice(copy.deepcopy(run.job), estimate)
    return run


def choose(job: JobConfig, device: Device, *, explicit: Iterable[str] = (),
           peak: Optional[Callable[[JobConfig], int]] = None) -> Choice:
    """``job`` with the settings that fill ``device`` fast (the module's docstring), keeping the
    ``explicit`` fields (dotted, without "job."). ``peak(job)``: the estimated peak bytes of one
    rank (None: the sizes are kept)."""
    if device.type != "cuda":
        return Choice(job, None)
    explicit = set(explicit)
    t = job.training
    if not explicit & set(PRECISION) and device.bf16 and t.mixed_precision_param == "float32":
        job = replace(job, training=replace(t, mixed_precision_param="bfloat16"))
    elif not explicit & set(PRECISION) and not device.bf16:  # (a recipe's bf16, where the GPU has none)
        job = replace(job, training=replace(t, dtype="float32", mixed_precision_param="float32"))
    if "compile.enable" not in explicit and device.compiles and not job.compile.enable:
        job = replace(job, compile=replace(job.compile, enable=True))
    if "model.attention" not in explicit and job.model.attention in KERNEL_ATTENTIONS:
        job = replace(job, model=replace(job.model, attention=_kernel(job, device)))
    p = job.parallelism
    if peak is None:
        sizes = "sizes as the recipe set them"
    elif set(SIZES) <= explicit:
        sizes = "sizes as given"  # (nothing to choose: no estimate)
    elif p.pp > 1 or p.cp > 1:
        sizes = "sizes as the recipe set them (pipeline or context parallel)"
    else:
        job, sizes = _sizes(job, device, explicit, peak)
    named = sorted(name for name in explicit if name in FIELDS)
    line = (f"titan-lightning: on {device.name} ({device.memory / GiB:.0f} GiB): {_precision(job, device)}, "
            f"{'compiled blocks' if job.compile.enable else 'eager'}, {job.model.attention} attention "
            f"({_mask(job)}), {sizes}" + (f"; explicit: {', '.join(named)}" if named else ""))
    return Choice(job, line)


def _kernel(job: JobConfig, device: Device) -> str:
    """The fastest kernel exact for the job's mask on ``device`` that the model accepts."""
    m = job.model
    window = getattr(m, "sliding_window", None) is not None
    if m.mask == "causal" and not window:
        return "sdpa"
    candidates = []
    if device.varlen and (device.varlen_window or not window) and job.training.mixed_precision_param == "bfloat16":
        candidates.append("varlen")
    if device.compiles:
        candidates.append("flex")
    for kernel in candidates:
        try:
            replace(job, model=replace(m, attention=kernel)).check_family()
        except ConfigError:
            continue  # (the family's rule, e.g. gpt-oss's sinks: not on varlen)
        return kernel
    return m.attention


def _sizes(job: JobConfig, device: Device, explicit: set, peak: Callable[[JobConfig], int]) -> tuple[JobConfig, str]:
    """(the job at the largest window and microbatch that fit, what was chosen and estimated)."""
    t, ac = job.training, job.activation_checkpoint
    limit = MEMORY_FRACTION * device.memory
    p = job.parallelism
    dp = p.dp_replicate * p.resolved_dp_shard(device.world_size)
    longest = max(t.seq_len, min(SEQ_LEN, getattr(job.model, "max_seq_len", t.seq_len)))
    lengths = [t.seq_len] if "training.seq_len" in explicit else list(dict.fromkeys([longest, t.seq_len]))
    if "training.tokens_per_microbatch_per_dp_rank" in explicit:
        lengths = [s for s in lengths if t.tokens_per_microbatch_per_dp_rank % s == 0]
    modes = [ac.mode] if "activation_checkpoint.mode" in explicit else list(dict.fromkeys([ac.mode, "full"]))

    def at(seq_len: int, k: int, mode: str) -> JobConfig:
        return replace(job, training=replace(t, seq_len=seq_len, tokens_per_microbatch_per_dp_rank=k * seq_len),
                       activation_checkpoint=replace(ac, mode=mode))

    # The first (window, checkpointing) whose fewest sequences fit, then the most sequences that
    # fit between those and the most considered (the peak is linear in them).
    low = None
    try:
        for seq_len, mode in ((s, m) for s in lengths for m in modes):
            counts = _counts(t, seq_len, dp, explicit)
            if not counts:  # (the recipe's tokens per step is no multiple of one window per rank)
                continue
            try:
                at(seq_len, counts[-1], mode).check_family()  # (a family may bound the window: LongRoPE)
            except ConfigError:
                continue
            low = peak(at(seq_len, counts[-1], mode))
            if low > limit:
                continue
            k, high = counts[-1], low
            if len(counts) > 1:
                top = peak(at(seq_len, counts[0], mode))
                per = (top - low) / (counts[0] - counts[-1])
                k = max(c for c in counts if c == counts[-1] or low + per * (c - counts[-1]) <= limit)
                high = top if k == counts[0] else low + per * (k - counts[-1])
            return at(seq_len, k, mode), _said(t, seq_len, k, mode, high, device)
    except Exception as err:  # noqa: BLE001 - what the estimator cannot model: say so, keep the sizes
        return job, f"sizes as the recipe set them (the estimator: {' '.join(str(err).split())[:160]})"
    where = "" if low is None else (f": estimated peak {low / GiB:.1f} GiB > {limit / GiB:.1f} "
                                    f"({MEMORY_FRACTION:.0%} of {device.memory / GiB:.0f})")
    return job, (f"sizes as the recipe set them, which do not fit one device{where} even at one sequence per "
                 f"microbatch with full activation checkpointing; add GPUs (FSDP shards the model over them)")


def _said(t, seq_len: int, k: int, mode: str, peak: float, device: Device) -> str:
    what = (f"seq_len {seq_len} x {k} per microbatch, {'no' if mode == 'none' else mode} activation "
            f"checkpointing (estimated peak {peak / GiB:.0f} GiB of {device.memory / GiB:.0f})")
    before = t.tokens_per_microbatch_per_dp_rank
    if k * seq_len != before and t.tokens_per_step is None:
        what += (f"; {k * seq_len} tokens per step per data-parallel rank, the recipe's "
                 f"{before // t.seq_len} x {t.seq_len} = {before}")
    return what


def _counts(t, seq_len: int, dp: int, explicit: set) -> list[int]:
    """The sequences per microbatch to consider at ``seq_len``, most first: powers of two up to
    TOKENS_PER_MICROBATCH tokens, that divide the recipe's tokens per step (where it sets one)."""
    if "training.tokens_per_microbatch_per_dp_rank" in explicit:
        return [t.tokens_per_microbatch_per_dp_rank // seq_len]
    counts, k = [], 1
    while k == 1 or k * seq_len <= TOKENS_PER_MICROBATCH:
        if t.tokens_per_step is None or t.tokens_per_step % (k * seq_len * dp) == 0:
            counts.insert(0, k)
        k *= 2
    return counts


def _precision(job: JobConfig, device: Device) -> str:
    t = job.training
    if t.mixed_precision_param == "float32":
        return "fp32" if device.bf16 else "fp32 (no bf16 on this GPU)"
    return "bf16-mixed" if t.dtype == "float32" else "bf16-true"


def _mask(job: JobConfig) -> str:
    m = job.model
    window = getattr(m, "sliding_window", None)
    return m.mask + (f", sliding window {window}" if window is not None else "")


# -- which fields the user set ----------------------------------------------------------------


def explicit_fields(run) -> set[str]:
    """The FIELDS the user set: named on the command line or by a --print_config file
    (``run.explicit``), set by ``trainer.precision``, or changed since the recipe (``for_device``)."""
    names = set().union(*(_covered(given) for given in run.explicit))
    if run.trainer.get("precision") is not None:
        names.update(PRECISION)
    recipe = run.device_choice.recipe if run.device_choice is not None else None
    names.update(f for f in FIELDS if recipe is not None and _field(run.job, f) != _field(recipe, f))
    return names


def _covered(given: str) -> set[str]:
    """The FIELDS an option sets: ``job.training.seq_len`` one, ``job.training`` every training
    one, ``trainer.precision`` the dtypes."""
    if given == "trainer.precision":
        return set(PRECISION)
    return {f for f in FIELDS if given in ("job", f"job.{f}") or f"job.{f}".startswith(given + ".")}


def _field(job: JobConfig, name: str) -> Any:
    value = job
    for part in name.split("."):
        value = getattr(value, part)
    return value


def named_fields(argv: list[str], config_text: Optional[str]) -> set[str]:
    """The --job.* and --trainer.* options ``argv`` gives, and those a --config file's
    ``# explicit:`` line lists."""
    names = {arg[2:].split("=", 1)[0].rstrip("+") for arg in argv
             if arg.startswith(("--job.", "--trainer.")) or arg == "--job" or arg.startswith("--job=")}
    for line in re.findall(f"^{re.escape(EXPLICIT_LINE)}(.*)$", config_text or "", re.MULTILINE):
        names.update(line.split())
    return names


def explicit_line(run, names: Iterable[str]) -> Optional[str]:
    """What --print_config adds for a run that lets the device choose: the options of the command
    line that set FIELDS, so that ``--config`` reproduces their being kept (None: nothing to add)."""
    kept = sorted(name for name in names if _covered(name))
    return EXPLICIT_LINE + " ".join(kept) if run.device_choice is not None and kept else None


def apply(run, trainer) -> None:
    """Choose the run's settings for ``trainer``'s device (before the job is validated), and say
    what was chosen on rank 0."""
    device = Device.of(trainer.strategy.root_device, trainer.world_size)
    if device.type != "cuda":
        return
    explicit = explicit_fields(run)
    # What the device cannot run is refused before the estimates (seconds each on a large model).
    validate_job(choose(run.job, device, explicit=explicit).job, world_size=trainer.world_size,
                 max_steps=trainer.max_steps, fake_pg=getattr(trainer.strategy, "fake_pg", False), device_type="cuda")
    choice = choose(run.job, device, explicit=explicit, peak=_estimator(run, trainer.world_size))
    # The estimates compiled the blocks on fake tensors at other shapes: the run compiles afresh, as
    # in a new process (no dimension marked dynamic by their recompiles).
    torch._dynamo.reset()
    # The estimates' fake models and traces leave ~50k objects in reference cycles (a Qwen 2 0.25B
    # folder): freed now, not by a full collection in the middle of a training step.
    gc.collect()
    run.set_job(choice.job)
    if trainer.global_rank == 0 and choice.line is not None:
        log.info(choice.line)


def _estimator(run, world_size: int) -> Callable[[JobConfig], int]:
    def peak(job: JobConfig) -> int:
        module = type(run.module)(copy.deepcopy(job))
        return run.device_choice.estimate(dataclasses.replace(run, module=module, datamodule=None,
                                                              trainer=dict(run.trainer)), world_size).peak

    return peak
