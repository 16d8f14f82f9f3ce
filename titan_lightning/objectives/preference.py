"""Preference losses on chosen / rejected pairs: DPO, IPO, SimPO, and the metrics TRL logs.

A microbatch of pairs (``data/preference.py``: ``PairWindows``) holds, per window, up to ``P``
pairs: sequence slots ``2k`` (pair k's chosen answer) and ``2k + 1`` (its rejected one). Each
label carries the slot of its sequence (``sequence_ids``, -1 where nothing is supervised), and each
slot the global index of its document in the shard set (``sequence_docs``, -1 for an empty slot),
by which precomputed reference log-probabilities are looked up.

A sequence's log-probability is the sum of its supervised tokens' log-probabilities: the negated
per-token losses of the chunked / vocab-parallel loss (``linear_cross_entropy(reduction="none")``),
so full logits never exist. IPO and SimPO use the mean over the sequence's supervised tokens
(as TRL's DPOTrainer for ``loss_type="ipo"`` and CPOTrainer for ``"simpo"``). With ``beta`` and the
differences ``pi = chosen - rejected`` (policy) and ``ref`` (reference), per pair:

    dpo     -(1 - eps) log sigmoid(beta (pi - ref)) - eps log sigmoid(-beta (pi - ref))
    ipo     ((pi - ref) - 1 / (2 beta))^2                         (length-averaged log-probs)
    simpo   -(1 - eps) log sigmoid(beta pi - gamma) - eps log sigmoid(gamma - beta pi)   (averaged, no reference)

and the rewards are ``beta (policy - reference)`` of each answer (SimPO: ``beta policy``). A step's
loss is the mean over the pairs of the whole optimizer step (every microbatch and data-parallel
rank): microbatches return the sum over their pairs, and the step divides by the pairs it held.
"""

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from titan_lightning.config.preference import PreferenceConfig
from titan_lightning.objectives.base import Objective, Record, StepEnd, TokenLoss, local
from titan_lightning.objectives.next_token import label_copies, scale_grads_, step_totals, sum_over_ranks
from titan_lightning.parallel.context import sequence_sums

# The folder of a pair set where precomputed reference log-probabilities are kept.
REFERENCE_FOLDER = "reference_logps"
# What each step and validation logs (TRL's names), each the mean over the pairs.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def sequence_logps(token_losses: torch.Tensor, sequence_ids: torch.Tensor,
                   sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability [sequences] fp32, supervised tokens [sequences]) of each sequence slot:
    the sum of ``-token_losses`` over the labels whose ``sequence_ids`` is the slot (-1: none).
    No host synchronization (no boolean indexing)."""
    ids = sequence_ids.flatten()
    keep = ids >= 0
    index = torch.where(keep, ids, 0)
    values = torch.where(keep, -token_losses.flatten().float(), 0.0)
    logps = torch.zeros(sequences, dtype=torch.float32, device=values.device).index_add(0, index, values)
    tokens = torch.zeros(sequences, dtype=torch.float32, device=values.device).index_add(0, index, keep.float())
    return logps, tokens


def window_logps(token_losses: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequence_logps`` of a batch of windows: [B x 2P] slots, window ``b``'s slot ``s`` at ``b * 2P + s``."""
    rows, slots = batch["sequence_docs"].shape
    ids = batch["sequence_ids"]
    offsets = torch.arange(rows, device=ids.device).unsqueeze(1) * slots
    return sequence_logps(token_losses, torch.where(ids >= 0, ids + offsets, -1), rows * slots)


def pair_losses(config: PreferenceConfig, logps: torch.Tensor, tokens: torch.Tensor,
                reference: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per pair: the loss [P] and the metrics of ``METRICS`` [P], from each slot's summed
    log-probability ``logps`` [2P] and supervised ``tokens`` [2P] (chosen at even slots), and the
    reference's summed log-probabilities ``reference`` [2P] (None for SimPO). A pair whose slots
    hold no token (an empty slot) has loss and metrics 0."""
    beta, eps = config.scale, float(config.label_smoothing)
    present = (tokens[0::2] > 0) & (tokens[1::2] > 0)
    # IPO's and SimPO's losses compare per-token means; the metrics are TRL's: DPOTrainer's summed
    # log-probabilities for DPO and IPO, CPOTrainer's means for SimPO.
    per_token = (lambda x: x / tokens.clamp(min=1)) if config.loss in ("ipo", "simpo") else (lambda x: x)
    if config.loss == "simpo":
        logps = per_token(logps)
        chosen, rejected = logps[0::2], logps[1::2]
        chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
        margin = beta * (chosen - rejected) - config.gamma
        loss = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
    else:
        if reference is None:
            raise ValueError(f"preference.loss={config.loss!r} compares with a reference model; no reference "
                             f"log-probabilities were given")
        scored, ref_scored = per_token(logps), per_token(reference).to(logps.dtype)
        logits = (scored[0::2] - scored[1::2]) - (ref_scored[0::2] - ref_scored[1::2])
        if config.loss == "ipo":
            loss = (logits - 1 / (2 * beta)) ** 2
        else:
            loss = -(1 - eps) * F.logsigmoid(beta * logits) - eps * F.logsigmoid(-beta * logits)
        reference = reference.to(logps.dtype)
        chosen, rejected = logps[0::2], logps[1::2]
        chosen_rewards = beta * (chosen - reference[0::2]).detach()
        rejected_rewards = beta * (rejected - reference[1::2]).detach()
    zero = torch.zeros_like(loss)
    metrics = {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
        "rewards/margins": chosen_rewards - rejected_rewards,
        "logps/chosen": chosen.detach(),
        "logps/rejected": rejected.detach(),
    }
    return torch.where(present, loss, zero), {k: torch.where(present, v, zero) for k, v in metrics.items()}


def batch_sums(config: PreferenceConfig, token_losses: torch.Tensor, batch: dict[str, torch.Tensor],
               reference: Optional[torch.Tensor] = None, group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One microbatch of windows: (the sum of its pairs' losses, 0-d with the gradient; fp64 [1 +
    len(METRICS)]: its pairs, then each metric's sum over them, detached). ``token_losses``
    [B, S]: each label's loss (0 where unsupervised); ``batch["sequence_ids"]`` [B, S] and
    ``batch["sequence_docs"]`` [B, 2P]; ``reference`` [documents of the set]: the precomputed
    reference log-probabilities (None: SimPO, or ``batch["reference_logps"]`` [B, 2P] from a
    reference model's forward). ``group``: the context-parallel ranks, each of which holds a slice of
    every sequence (its ``token_losses`` and ``sequence_ids``): the sequences' sums are theirs together."""
    docs = batch["sequence_docs"]
    logps, tokens = window_logps(token_losses, batch)
    if group is not None:
        logps, tokens = sequence_sums(logps, group), sequence_sums(tokens, group)
    if "reference_logps" in batch:
        reference = batch["reference_logps"].flatten()
    elif reference is not None:
        reference = torch.where(docs >= 0, reference[docs.clamp(min=0)], 0.0).flatten()
    losses, metrics = pair_losses(config, logps, tokens, reference)
    pairs = ((tokens[0::2] > 0) & (tokens[1::2] > 0)).double().sum()
    stats = torch.stack([pairs, *(metrics[name].double().sum() for name in METRICS)])
    return losses.sum(), stats


@torch.no_grad()
def reference_pass(token_losses, batches, documents: int, device: torch.device) -> torch.Tensor:
    """Each document's summed log-probability [documents] fp64 (0 for documents no batch holds):
    ``token_losses(batch)`` [B, S] over every batch (``sequence_ids``, ``sequence_docs`` as above),
    under no_grad: the reference's log-probabilities, from the starting weights, in one pass."""
    out = torch.zeros(documents, dtype=torch.float64, device=device)
    for batch in batches:
        _add_to_documents(out, token_losses(batch), batch)
    return out


def _add_to_documents(out: torch.Tensor, token_losses: torch.Tensor, batch: dict[str, torch.Tensor]) -> None:
    """Add each slot's summed log-probability (``window_logps``) to ``out`` [documents] at its document."""
    logps, _ = window_logps(token_losses, batch)
    flat = batch["sequence_docs"].flatten()
    keep = flat >= 0
    out.index_add_(0, torch.where(keep, flat, 0), torch.where(keep, logps.double(), 0.0))


class PairMean(Objective):
    """The preference loss (``job.preference``) averaged over the pairs of the whole optimizer step
    (every microbatch and data-parallel rank), and TRL's metrics averaged over the same pairs.

    Each microbatch's loss is the sum over its pairs; ``end_step`` multiplies the step's gradients
    by K / N (K: the microbatch losses of the step over all ranks, which gradient accumulation and
    the data-parallel reduction averaged; N: the step's pairs), as ``StepTokenMean`` does with
    tokens. The reference's log-probabilities: ``reference``, precomputed [documents of the set] by
    the module before training; or ``reference_losses(batch)``, the per-token losses of the
    reference's forward of the batch (the model with its LoRA adapters off), run here without
    gradients; neither for SimPO.

    ``mesh``: under context parallelism each rank holds a slice of every sequence; the ranks of its
    ``cp`` dim sum their parts of each sequence's log-probability before the pair loss, and each
    counts a ``cp``-th of the pairs, their loss and metrics (K counts each rank's microbatch losses,
    which the gradient reduction averages over ``cp`` too)."""

    label_rows = True

    def __init__(self, token_loss: TokenLoss, config: PreferenceConfig, mesh: Any = None) -> None:
        super().__init__(token_loss)
        self.config = config
        self.reference: Optional[torch.Tensor] = None
        self.reference_losses: Optional[Callable[[dict[str, torch.Tensor]], torch.Tensor]] = None
        names = getattr(mesh, "mesh_dim_names", None) or ()
        cp = mesh["cp"] if "cp" in names and mesh["cp"].size() > 1 else None
        self.sequence_group = None if cp is None else cp.get_group()
        self._share = 1.0 if cp is None else 1.0 / cp.size()  # of each pair this rank counts
        self._sums: list[torch.Tensor] = []  # per microbatch: loss sum, pairs, metric sums (fp64)
        self._eval: Optional[torch.Tensor] = None  # the same over the held-out batches
        self._collect: Optional[torch.Tensor] = None  # precompute_reference's sums [documents] fp64

    def _sums_of(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        token_losses = local(self.batch_loss(output, batch, "none"))
        reference = self.reference
        if self.config.needs_reference and self.reference_losses is not None:
            with torch.no_grad():
                logps = window_logps(self.reference_losses(batch), batch)[0]
                if self.sequence_group is not None:
                    logps = sequence_sums(logps, self.sequence_group)
                batch = {**batch, "reference_logps": logps}
        if self.config.needs_reference and reference is None and "reference_logps" not in batch:
            raise RuntimeError(f"preference.loss={self.config.loss!r} needs the reference's log-probabilities, and "
                               f"none were computed (preference.reference={self.config.reference!r})")
        total, stats = batch_sums(self.config, token_losses, batch, reference, self.sequence_group)
        return total, torch.cat([local(total).detach().double().reshape(1), stats]) * self._share

    def loss(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[Record]]:
        total, sums = self._sums_of(output, batch)
        self._sums.append(sums)
        return total, []

    def end_step(self, grads: list[torch.Tensor], device: torch.device, mesh: Any) -> StepEnd:
        sums, self._sums = self._sums, []
        device = grads[0].device if grads else device
        totals = step_totals(sums, 2 + 1 + len(METRICS), device)  # [microbatches, loss sum, pairs, metric sums]
        microbatches, loss_sum, pairs = totals[0], totals[1], totals[2]
        scale_grads_(grads, microbatches / pairs.clamp(min=1.0))
        loss = (loss_sum / pairs.clamp(min=1.0)).float()
        return StepEnd([loss], pairs, [("train/loss", loss, {}), *_metric_records("train", totals[2:], mesh)])

    def eval_loss(self, output: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the mean loss over the batch's pairs, their number); the metrics' sums kept for ``eval_records``.
        During ``precompute_reference``'s pass: each document's log-probability (this rank's part)
        added to its sums instead, weight 0."""
        if self._collect is not None:
            _add_to_documents(self._collect, local(self.batch_loss(output, batch, "none")), batch)
            zero = torch.zeros((), device=self._collect.device)
            return zero, zero
        _, sums = self._sums_of(output, batch)
        self._eval = sums if self._eval is None else self._eval + sums
        pairs = sums[1]  # (under CP, this rank's share of them)
        return (sums[0] / pairs.clamp(min=self._share)).float(), pairs

    def eval_records(self, prefix: str, loss: torch.Tensor, mesh: Any) -> list[Record]:
        """The held-out pairs' metrics (``prefix``/rewards/chosen, ...), over every rank; on every rank
        (a perplexity of a preference loss means nothing)."""
        sums, self._eval = self._eval, None
        totals = torch.zeros(2 + len(METRICS), dtype=torch.float64, device=loss.device)
        if sums is not None:  # (none on a rank that validated no batch)
            totals += sums.to(loss.device)
        sum_over_ranks(totals)
        # The same on every rank (reduced above): the max over the ranks returns it unchanged.
        return [(name, value, {"sync_dist": True, "reduce_fx": "max"})
                for name, value, _ in _metric_records(prefix, totals[1:], mesh)]


def _metric_records(prefix: str, totals: torch.Tensor, mesh: Any) -> list[Record]:
    """``totals`` [pairs, metric sums] (summed over every rank) as the means of METRICS over the pairs."""
    pairs = totals[0].clamp(min=1.0)
    records = [(f"{prefix}/{name}", (totals[1 + k] / pairs).float(), {}) for k, name in enumerate(METRICS)]
    return [*records, (f"{prefix}/pairs", totals[0].float() / label_copies(mesh), {})]


def precompute_reference(trainer, mesh: Any, cache: Optional[Path] = None) -> torch.Tensor:
    """The reference log-probability of every document of the pairs' shard set [documents] fp32 on
    the module's device: the model as it starts (before any step) over every train and held-out
    window once, under no_grad, each data-parallel rank a share of the windows (all ranks run as
    many batches: a rank short of windows runs fillers that add nothing), summed over the ranks.
    Each batch runs as a validation step of the strategy (so on every layout: a CP rank's slice,
    TP's loss parallel, the pipeline's stages), the module's ``PairMean`` adding each sequence's
    log-probability (its part of it) in place of the loss. ``cache``: a ``.npy`` file read instead
    when it exists (same starting weights and layout), written by rank 0 otherwise; none under the
    fake process group (its numbers are no reference)."""
    from torch.utils.data import default_collate

    datamodule = trainer.datamodule
    windows = [w for w in (datamodule.train_windows(), datamodule.val_windows) if w is not None]
    documents = len(windows[0].tokens.shards.document_ends())
    device = trainer.strategy.root_device
    cache = None if getattr(trainer.strategy, "fake_pg", False) else cache
    if cache is not None and cache.is_file():
        saved = np.load(cache)
        if saved.shape == (documents,):
            return torch.from_numpy(saved).to(device=device, dtype=torch.float32)
    kwargs = trainer.distributed_sampler_kwargs or {}
    size, rank = kwargs.get("num_replicas", 1), kwargs.get("rank", 0)
    per_batch = datamodule.job.training.microbatch_size
    prepare = trainer.lightning_module.prepare_batch_on_host

    def batches():
        for dataset in windows:
            share = per_batch * -(-len(dataset) // (size * per_batch))  # (whole batches: pipeline microbatches)
            mine = list(range(rank, len(dataset), size))
            samples = [dataset[i] for i in mine] + [_filler(dataset[0]) for _ in range(share - len(mine))]
            for first in range(0, share, per_batch):
                yield trainer.strategy.batch_to_device(prepare(default_collate(samples[first:first + per_batch])))

    objective = trainer.lightning_module.objective
    out = torch.zeros(documents, dtype=torch.float64, device=device)
    objective._collect = out
    try:
        with torch.no_grad():
            for index, batch in enumerate(batches()):
                trainer.strategy.validation_step(batch, index)
    finally:
        objective._collect = None
    sum_over_ranks(out)  # (CP ranks' parts add up; pipeline stages before the last add nothing)
    out = (out / label_copies(mesh)).float()
    if cache is not None and rank == 0 and trainer.global_rank == 0:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            partial = cache.with_suffix(".partial.npy")
            np.save(partial, out.cpu().numpy())
            partial.replace(cache)
        except OSError as err:  # a read-only data folder: the pass runs again next time
            warnings.warn(f"the reference log-probabilities cannot be kept in {cache.parent} ({err.strerror}); the "
                          f"next run computes them again", stacklevel=2)
    return out


def _filler(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sample`` with no sequence: its forward runs (every rank runs as many) and adds nothing."""
    return {**sample, "sequence_ids": torch.full_like(sample["sequence_ids"], -1),
            "sequence_docs": torch.full_like(sample["sequence_docs"], -1)}


def reference_cache(job: Any) -> Optional[Path]:
    """Where ``precompute_reference`` keeps the reference of ``job``'s starting weights: next to the
    shards, ``reference_logps/<hash>.npy``, the hash of what decides the numbers (the weights loaded,
    by their files' names, sizes and times; else the init seed; the model, its adapters, its
    precision; with ``training.deterministic``, the layout and the microbatch too, whose sums run
    in another order: such a run reads only what its own layout wrote, so it repeats bit for bit;
    other runs share the reference of the same weights, whatever the layout that computed it)."""
    if job.data.dataset_path is None:
        return None
    load = job.checkpoint.initial_load_path
    files = sorted(Path(load).rglob("*")) if load is not None and Path(load).is_dir() else \
        [Path(load)] if load is not None else []
    weights = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    key = json.dumps({"weights": weights, "load": load, "seed": None if load else job.training.seed,
                      "model": repr(job.model), "lora": repr(job.lora), "quantize": repr(job.quantize),
                      "dtype": job.training.dtype,
                      "compute": job.training.mixed_precision_param, "seq_len": job.training.seq_len,
                      "packing": job.data.sft_packing,
                      **({"layout": repr(job.parallelism), "microbatch": job.training.tokens_per_microbatch_per_dp_rank}
                         if job.training.deterministic else {})}, sort_keys=True)
    return Path(job.data.dataset_path) / REFERENCE_FOLDER / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.npy"
