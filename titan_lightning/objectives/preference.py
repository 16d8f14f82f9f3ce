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

from typing import Optional

import torch
import torch.nn.functional as F

from titan_lightning.config.preference import PreferenceConfig

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
    if config.loss in ("ipo", "simpo"):
        logps = logps / tokens.clamp(min=1)
        if reference is not None:
            reference = reference / tokens.clamp(min=1)
    chosen, rejected = logps[0::2], logps[1::2]
    if config.loss == "simpo":
        chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
        margin = beta * (chosen - rejected) - config.gamma
        loss = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
    else:
        if reference is None:
            raise ValueError(f"preference.loss={config.loss!r} compares with a reference model; no reference "
                             f"log-probabilities were given")
        reference = reference.to(logps.dtype)
        ref_chosen, ref_rejected = reference[0::2], reference[1::2]
        logits = (chosen - rejected) - (ref_chosen - ref_rejected)
        if config.loss == "ipo":
            loss = (logits - 1 / (2 * beta)) ** 2
        else:
            loss = -(1 - eps) * F.logsigmoid(beta * logits) - eps * F.logsigmoid(-beta * logits)
        chosen_rewards = beta * (chosen - ref_chosen).detach()
        rejected_rewards = beta * (rejected - ref_rejected).detach()
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
               reference: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One microbatch of windows: (the sum of its pairs' losses, 0-d with the gradient; fp64 [1 +
    len(METRICS)]: its pairs, then each metric's sum over them, detached). ``token_losses``
    [B, S]: each label's loss (0 where unsupervised); ``batch["sequence_ids"]`` [B, S] and
    ``batch["sequence_docs"]`` [B, 2P]; ``reference`` [documents of the set]: the precomputed
    reference log-probabilities (None: SimPO, or ``batch["reference_logps"]`` [B, 2P] from a
    reference model's forward)."""
    docs = batch["sequence_docs"]
    logps, tokens = window_logps(token_losses, batch)
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
        logps, _ = window_logps(token_losses(batch), batch)
        flat = batch["sequence_docs"].flatten()
        keep = flat >= 0
        out.index_add_(0, torch.where(keep, flat, 0), torch.where(keep, logps.double(), 0.0))
    return out
