"""The LightningModule every model family shares: the model, its objective (objectives/), optimizer,
schedule, gradient clipping and the finiteness check."""

import copy
import functools
import inspect
import math
from contextlib import nullcontext
from typing import Any, ClassVar, Optional

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.fsdp import FSDPModule

from titan_lightning._compat import unset_fake_temporarily
from titan_lightning.config import ConfigError, JobConfig
from titan_lightning.lora import (adapters_off, add_job_adapters, base_only, check_lora_job, quantize_base_nf4,
                                  store_frozen_in)
from titan_lightning.lora.peft_import import check_init_from
from titan_lightning.models.common.decoder import Decoder, decoder_class
from titan_lightning.models.common.init import canonical_fqn
from titan_lightning.models.common.loss import IGNORE_INDEX
from titan_lightning.models.common.masking import varlen_offsets
from titan_lightning.models.common.moe import update_expert_bias
from titan_lightning.models.reference_copy import sharded_copy
from titan_lightning.objectives import MicrobatchTokenMean, Objective, Record, StepTokenMean
from titan_lightning.objectives.base import LABEL_ROWS, local
from titan_lightning.objectives.preference import PairMean, precompute_reference, reference_cache
from titan_lightning.optim import build_lr_scheduler, build_optimizer
from titan_lightning.parallel.compile import compile_loss
from titan_lightning.parallel.contracts import PipelinePlan
from titan_lightning.parallel.grad_norm import clip_grads_, global_grad_norm
from titan_lightning.parallel.mesh import Mesh


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the tokens whose label is not IGNORE_INDEX, in fp32.

    Vocab-sharded logits (a DTensor, from loss parallel) give a replicated DTensor loss;
    the strategy runs this and the backward inside ``loss_parallel()``.
    """
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="mean"
    )


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The sum of the cross entropies over the tokens whose label is not IGNORE_INDEX, in fp32 (what
    loss-masked training divides by the supervised tokens of the whole optimizer step)."""
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each token's cross entropy, in fp32, shaped as ``labels``; 0 where the label is IGNORE_INDEX."""
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape)


# The plain cross entropy of each reduction ``CausalLMModule.token_loss`` takes.
_PLAIN_LOSSES = {"mean": cross_entropy_loss, "sum": cross_entropy_sum, "none": token_cross_entropy}
# A batch's labelled rows (``prepare_batch_on_host``), when they are at most this share of its tokens
# (a pretraining batch, every token but each document's last labelled, keeps the plain path).
LABEL_ROWS_SHARE = 0.9


class CausalLMModule(L.LightningModule):
    """A causal language model trained on {"input_ids", "labels"} batches.

    ``job.model``'s args class picks the family's decoder (models/common/decoder.py), which
    declares the tensor-parallel plan and the FLOP terms; a family's subclass adds only its
    Hugging Face adapter class (``hf_adapter``). A module of another kind overrides
    ``build_model`` (an ``nn.Module`` with ``init_weights(seed)``) and sets ``tp_plan``.
    The model is built on the meta device in ``configure_model`` and materialized with a
    deterministic, layout-independent init. A strategy that parallelizes the model sets
    ``materializes_model = True`` and calls ``materialize`` itself after sharding.
    """

    # The family's Hugging Face state-dict adapter class (models/common/hf_checkpoint.py), or None.
    hf_adapter: ClassVar[Optional[type]] = None

    def __init__(self, job: JobConfig) -> None:
        super().__init__()
        self.job = job
        self.model: Optional[torch.nn.Module] = None
        self.val_loss = torchmetrics.MeanMetric()
        self.last_grad_norm: Optional[torch.Tensor] = None
        self._objective: Optional[Objective] = None
        # preference.reference="frozen": a copy of the model as it starts, outside the module's children.
        self._frozen: Optional[torch.nn.Module] = None
        # The cross entropy of each reduction, built on first use (token_loss).
        self._token_losses: dict[str, Any] = {}
        # The last clipped step's losses and norm, not yet read on the host (check_finite).
        self._unchecked: Optional[_Unchecked] = None
        self._adapters: Optional[int] = None  # (the LoRA adapters' parameters, counted on first use)
        # materialize drew no random values for the parameters checkpoint.initial_load_path overwrites.
        self.init_skipped = False

    @property
    def loss_over_step_tokens(self) -> bool:
        """True when the loss is the sum over supervised tokens divided by the supervised tokens of
        the whole optimizer step (all microbatches, data-parallel and context-parallel ranks):
        loss-masked fine-tuning (``data.sft``), where microbatches hold different numbers of
        supervised tokens and a mean per microbatch or per rank would weigh them wrongly."""
        return bool(getattr(self.job.data, "sft", False))

    @property
    def decoder_class(self) -> Optional[type[Decoder]]:
        """The family's decoder for ``job.model``'s args class; None if no Decoder declares it."""
        return decoder_class(type(self.job.model))

    @classmethod
    def check_config(cls, job: JobConfig) -> None:
        """The family's own rules for ``job`` (its Hugging Face adapter's), before launch: a family's
        job runs them from ``validate_job`` (``JobConfig.check_family``)."""
        decoder = decoder_class(type(job.model))
        window = getattr(job.model, "sliding_window", None)
        if window is not None and decoder is not None and not decoder.sliding_window:
            raise ConfigError(f"model.sliding_window={window}: {type(job.model).__name__}'s attention has no sliding "
                              f"window ({decoder.__module__}); leave model.sliding_window unset (None)")
        if cls.hf_adapter is not None:
            cls.hf_adapter.check_config(job)
        if job.lora.enabled and decoder is not None:
            with torch.device("meta"):
                check_lora_job(job, decoder(job.model), cls.hf_adapter(job.model) if cls.hf_adapter else None)

    def check_fresh_start(self) -> None:
        """Before a fit that starts from step 0 (a resumed one takes its checkpoint's adapters and
        never reads ``lora.init_from``): the PEFT folder's adapters are the job's (rank, alpha,
        targets; one line with the options that fit) and every tensor of it has its place."""
        lora = self.job.lora
        if not lora.enabled or lora.init_from is None or self.decoder_class is None:
            return
        with torch.device("meta"):
            check_init_from(lora, self.decoder_class(self.job.model), self.state_dict_adapter())

    def build_model(self) -> torch.nn.Module:
        if self.decoder_class is None:
            raise NotImplementedError(
                f"{type(self).__name__}: no Decoder declares model args {type(self.job.model).__name__}; subclass "
                f"models.common.decoder.Decoder with args_class = {type(self.job.model).__name__}, or override build_model()"
            )
        model = self.decoder_class(self.job.model)
        model.head_in_loss = self.job.training.loss_chunks is not None
        lora = self.job.lora
        if lora.enabled:  # (the model as it trains: a checkpoint's and a load's names see its adapters)
            add_job_adapters(model, lora, self.state_dict_adapter())
            if lora.quantize_base == "nf4":  # (QLoRA: NF4 from the start, so FSDP2 shards the base as NF4)
                store_frozen_in(model, getattr(torch, self.job.training.mixed_precision_param))
                quantize_base_nf4(model, next(model.parameters()).device)
        return model

    # -- model lifecycle ---------------------------------------------------------------

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with torch.device("meta"):
            self.model = self.build_model()
        chunks = self.job.training.loss_chunks
        if chunks is not None and not getattr(self.model, "head_in_loss", False):
            raise ConfigError(
                f"training.loss_chunks={chunks} needs a model whose loss applies its head "
                f"(models.common.decoder.Decoder); {type(self.model).__name__} is not one: set loss_chunks=None"
            )
        if not getattr(self.trainer.strategy, "materializes_model", False):
            self.materialize(self.trainer.strategy.root_device)

    def materialize(self, device: torch.device) -> None:
        self.allocate(device)
        loader = self._base_loader()
        if loader is None:
            self.model.init_weights(self.job.training.seed)
        else:  # (an 8B base's random draw cost ~a minute of CPU before every fine-tune; a 70B's ~5)
            with base_only(self.model) as base:
                loaded = frozenset(canonical_fqn(name) for name, _ in base.named_parameters())
            self.model.init_weights(self.job.training.seed, loaded=loaded)
            if self.trainer.state.fn != TrainerFn.FITTING:  # (a fit loads in on_fit_start)
                loader.load(self, partial=self.job.parallelism.pp > 1)
        self.init_skipped = loader is not None  # (LoadWeights then loads even in a resumed fit)

    def _base_loader(self) -> Optional[Any]:
        """The callback that loads every parameter but the adapters before they are read
        (``checkpoint.initial_load_path``: LoadWeights, when its ``loads_base`` says so), whose random
        init is then not drawn; None when there is none, or the model's ``init_weights`` draws all (it
        takes no ``loaded``). A fit loads in on_fit_start, the other commands here, as the model is made
        (before Lightning restores their ``ckpt_path`` over it)."""
        trainer = self._trainer
        if trainer is None or "loaded" not in inspect.signature(self.model.init_weights).parameters:
            return None
        return next((c for c in trainer.callbacks if callable(getattr(c, "loads_base", None))
                     and c.loads_base(trainer, self)), None)

    def allocate(self, device: torch.device, model: Optional[torch.nn.Module] = None) -> None:
        """The storage of ``model`` (default ``self.model``; another of ``build_model``'s, such as a
        frozen reference) on ``device`` as it trains, its values not yet drawn (the estimator
        allocates fake tensors so): cast before the init (init_weights keeps its fp32 buffers, RoPE's,
        in fp32), a LoRA base frozen in the compute dtype, QLoRA's NF4 base."""
        model = self.model if model is None else model
        # (dtype casts of the meta model: under the estimator's fake mode a cast would make a fake tensor
        # that can only be swapped in, and the mode's own memo holds a weakref that forbids the swap)
        with unset_fake_temporarily():
            model.to(getattr(torch, self.job.training.dtype))
            if self.job.lora.enabled:
                store_frozen_in(model, getattr(torch, self.job.training.mixed_precision_param))
        if self.job.lora.enabled and self.job.lora.quantize_base == "nf4":
            quantize_base_nf4(model, device)  # (QLoRA: the init and a load quantize what they copy in)
        model.to_empty(device=device)

    @property
    def tp_plan(self) -> Optional[dict[str, str]]:
        """Module names (relative to this LightningModule) -> tensor-parallel styles."""
        plan = self.decoder_class.tp_plan(self.job.model) if self.decoder_class is not None else None
        return None if plan is None else {f"model.{name}": style for name, style in plan.items()}

    # What a pipeline split cuts: model.layers (a ModuleDict), embeddings first, norm and head last.
    pipeline_plan: PipelinePlan = PipelinePlan()

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits; ``position_ids`` (document boundaries) reach the model only when ``model.mask`` /
        ``model.positions`` use them."""
        out = self.loss_input(input_ids, position_ids)
        if getattr(self.model, "head_in_loss", False):
            with self._autocast(input_ids.device.type):
                return self.model.output(out)
        return out

    def loss_input(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                   varlen_offsets: Optional[tuple[torch.Tensor, int]] = None) -> torch.Tensor:
        """What ``token_loss`` takes: the logits, or with ``training.loss_chunks`` the final norm's
        hidden states (the loss applies the head, chunk by chunk). ``varlen_offsets``: the batch's
        documents for varlen attention, computed on the host (``prepare_batch_on_host``)."""
        return self._run_model(*self._model_args(input_ids, position_ids, varlen_offsets))

    def model_input(self, batch: dict[str, Any]) -> tuple[tuple, dict]:
        """The arguments ``self.model`` is called with for ``batch``: its token ids, the document
        boundaries when ``model.mask`` / ``model.positions`` use them, and the document offsets and
        the labelled rows when ``prepare_batch_on_host`` made them. What the first pipeline stage takes."""
        offsets = (batch["cu_seqlens"], batch["max_seqlen"]) if "cu_seqlens" in batch else None
        args, kwargs = self._model_args(batch["input_ids"], batch.get("position_ids"), offsets)
        rows = batch.get(LABEL_ROWS)
        if rows is not None and not self.model.head_in_loss:  # (the head runs on those rows alone)
            kwargs["label_rows"] = rows
        return args, kwargs

    def _model_args(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor],
                    varlen_offsets: Optional[tuple[torch.Tensor, int]]) -> tuple[tuple, dict]:
        m = self.job.model
        extra = (position_ids,) if (m.mask, m.positions) != ("causal", "global") else ()
        return (input_ids, *extra), ({} if varlen_offsets is None else {"varlen_offsets": varlen_offsets})

    def _run_model(self, args: tuple, kwargs: dict) -> torch.Tensor:
        with self._autocast(args[0].device.type):
            return self.model(*args, **kwargs)

    def _batch_input(self, batch: dict[str, Any]) -> torch.Tensor:
        """``loss_input`` of a batch (its document offsets too, when ``prepare_batch_on_host`` made them)."""
        return self._run_model(*self.model_input(batch))

    def prepare_batch_on_host(self, batch: Any) -> Any:
        """What the batch's forward needs from its values, computed here, on the host, before the
        batch goes to the device (``TextDataModule.on_before_batch_transfer`` calls this; a
        LightningModule overriding that hook itself makes Lightning warn on every run that passes a
        data module); computed on the device, reading them would make the host wait for the device
        before every forward (on an H200 the device then idled ~7% of a Qwen 2.5 1.5B SFT step):

        - with varlen attention over documents (``model.mask`` block_causal), the document offsets
          (``cu_seqlens``) and the longest document (``max_seqlen``);
        - where a share of the tokens carries no label (fine-tuning's prompts, a preference pair's
          prompt: ``label_rows``), the rows that do: the head and the loss run on those alone,
          saving the head's matmuls and the cross entropy of the rest (the same loss and gradients;
          not under tensor or context parallelism, whose head sees other rows, nor for an objective
          of one's own that calls ``token_loss`` with whole labels: ``Objective.label_rows``).

        Not under pipeline parallelism (its schedule splits the batch into microbatches)."""
        p = self.job.parallelism
        if p.pp > 1 or not isinstance(batch, dict):
            return batch
        m, positions, labels = self.job.model, batch.get("position_ids"), batch.get("labels")
        extra = {}
        if (getattr(m, "attention", None) == "varlen" and getattr(m, "mask", "causal") == "block_causal"
                and positions is not None and positions.device.type == "cpu" and positions.dim() == 2):
            extra["cu_seqlens"], extra["max_seqlen"] = varlen_offsets(positions, *positions.shape, positions.device)
        if (p.tp == 1 and p.cp == 1 and self.decoder_class is not None and labels is not None
                and labels.device.type == "cpu" and self.objective.label_rows):
            rows = (labels.flatten() != IGNORE_INDEX).nonzero().flatten()
            if 0 < rows.numel() <= LABEL_ROWS_SHARE * labels.numel():
                extra[LABEL_ROWS] = rows
        return {**batch, **extra} if extra else batch

    def _autocast(self, device_type: str):
        """bf16 autocast over fp32 parameters; FSDP casts parameters itself (MixedPrecisionPolicy)."""
        t = self.job.training
        if t.mixed_precision_param == "bfloat16" and t.dtype == "float32" and not isinstance(self.model, FSDPModule):
            return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
        return nullcontext()

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at ``seq_len``, torchtitan's estimate:
        6 x the parameters a token computes with (embedding lookups excluded, routed experts
        counted top_k times) + 6 x layers x heads x (query-key + value head dims) x seq_len for
        the attention scores (causal masking not discounted; a sliding layer counts min(window,
        seq_len) keys per query, not seq_len). Families implement ``_flop_terms``. With LoRA the
        frozen base computes no weight gradients: 4 x its parameters (the forward and the
        activations' gradient), 6 x the adapters' (all of them: an MoE's per-expert adapters
        counted whole, a bound)."""
        matmul_params, attention_per_position = self._flop_terms()
        args = self.job.model
        windows = [args.attention_window(i) for i in range(args.n_layers)]
        span = sum(seq_len if w is None else min(w, seq_len) for w in windows) / max(len(windows), 1)
        weights = 6.0 * matmul_params
        if self.job.lora.enabled:
            weights = 4.0 * matmul_params + 6.0 * self._adapter_parameters()
        return weights + 6.0 * attention_per_position * span

    def _adapter_parameters(self) -> int:
        """The whole model's adapter parameters (counted once, on a meta build: not a pipeline
        stage's or a shard's, and the same for a benchmark's contender that never builds ours)."""
        if self._adapters is None:
            with torch.device("meta"):
                model = self.build_model()
            self._adapters = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
        return self._adapters

    def _flop_terms(self) -> tuple[int, int]:
        """(parameters a token multiplies with, layers x heads x (d_qk + d_v))."""
        if self.decoder_class is None:
            raise NotImplementedError(f"{type(self).__name__} does not estimate its FLOPs")
        return self.decoder_class.flop_terms(self.job.model)

    def state_dict_adapter(self):
        """The family's Hugging Face state-dict adapter for ``job.model``, or None."""
        return self.hf_adapter(self.job.model) if self.hf_adapter is not None else None

    # -- the objective ---------------------------------------------------------------------

    @property
    def objective(self) -> Objective:
        """What a step optimizes (titan_lightning/objectives/): built once, by ``build_objective``."""
        if self._objective is None:
            self._objective = self.build_objective()
        return self._objective

    def build_objective(self) -> Objective:
        """The job's objective: with ``loss_over_step_tokens``, the mean over the supervised tokens of
        the whole step, else the mean over each microbatch's labelled tokens. A module with another
        objective overrides this (it reaches the cross entropy through ``token_loss``)."""
        if self.job.preference.enabled:
            return PairMean(self.token_loss, self.job.preference, self.device_mesh)
        kind = StepTokenMean if self.loss_over_step_tokens else MicrobatchTokenMean
        return kind(self.token_loss)

    def on_fit_start(self) -> None:
        """Preference training's reference (``preference.reference``): "precomputed", the reference's
        log-probabilities of every pair from the starting weights, in one pass before the first step
        (kept next to the shards for the next run of the same weights); "adapters_off", each batch's
        forward through the model with its LoRA adapters switched off, in every step."""
        objective = self.objective
        if not (isinstance(objective, PairMean) and objective.config.needs_reference):
            return
        reference, cache = objective.config.reference, reference_cache(self.job)
        if self.trainer.ckpt_path is not None and (reference == "frozen" or (
                reference == "precomputed" and objective.reference is None and (cache is None or not cache.is_file()))):
            # The model is the checkpoint's now, not the starting one the reference is.
            where = "is not in the checkpoint" if reference == "frozen" else f"is not kept ({cache} is gone)"
            raise RuntimeError(f"resuming {self.trainer.ckpt_path}: the reference model (preference.reference="
                               f"{reference!r}, the starting weights) {where}; start the run again, or use "
                               f"'precomputed' with the shards' reference_logps/ kept")
        if objective.config.reference in ("adapters_off", "frozen"):
            self.attach_reference(getattr(self.trainer.strategy, "mesh", None))
        elif objective.reference is None:
            objective.reference = precompute_reference(self.trainer, self.device_mesh, cache)

    def attach_reference(self, mesh: Any) -> Optional[torch.nn.Module]:
        """The reference's forward in every step (``preference.reference`` "adapters_off" or "frozen"),
        as a run and the estimator set it up. For "frozen", the parallelized, loaded model copied (by
        ``mesh``'s layout): the same shards, units of its own, no gradients, no optimizer state; kept
        out of the module's children (its state dict, checkpoints, parameters) and returned (None for
        "adapters_off", which holds no second model)."""
        if self.job.preference.reference == "frozen" and self._frozen is None:
            self.__dict__["_frozen"] = (sharded_copy(self, mesh) if isinstance(mesh, Mesh)
                                        else copy.deepcopy(self.model).requires_grad_(False))
        self.objective.reference_losses = self._reference_losses
        return self._frozen

    def _reference_losses(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each label's loss under the reference (the model, with its adapters off for
        ``preference.reference="adapters_off"``), without gradients."""
        reference = self.job.preference.reference
        off = adapters_off(self.model) if reference == "adapters_off" else nullcontext()
        model = self._modules["model"]
        if reference == "frozen":  # the frozen copy in the model's place, for this forward and its loss
            self._modules["model"] = self._frozen
        try:
            with torch.no_grad(), off:
                return local(self.objective.batch_loss(self._batch_input(batch), batch, "none"))
        finally:
            self._modules["model"] = model

    def token_loss(self, output: torch.Tensor, labels: torch.Tensor, reduction: str = "mean",
                   rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The cross entropy of what ``loss_input`` returned against ``labels``, over the labelled
        tokens: their mean, their sum, or ("none") each token's, shaped as ``labels``. On the logits,
        compiled when ``compile.enable`` and "loss" in ``compile.components``; with
        ``training.loss_chunks``, the head's own chunked loss on the hidden states (eager: it holds
        no full logits to fuse away). ``rows``: the batch's labelled rows (its ``label_rows``), the
        only ones the model computed logits for (or, with ``loss_chunks``, the head computes)."""
        if reduction not in self._token_losses:
            self._token_losses[reduction] = self._build_loss_fn(reduction)
        if rows is None:
            return self._token_losses[reduction](output, labels)
        chosen = labels.flatten().index_select(0, rows)
        if self.job.training.loss_chunks is None:  # (the model computed these rows' logits alone)
            losses = self._token_losses[reduction](output, chosen)
        else:  # the head's chunks of the batch's chunk size, the last filled with unlabelled rows: the
            size = -(-labels.numel() // self.job.training.loss_chunks)  # chunk kernels see no new shape
            pad = -rows.numel() % size
            h = output.flatten(0, -2).index_select(0, torch.cat([rows, rows.new_zeros(pad)]) if pad else rows)
            chosen = torch.cat([chosen, chosen.new_full((pad,), IGNORE_INDEX)]) if pad else chosen
            losses = self._head_loss(h, chosen, reduction, chunks=h.shape[0] // size)
        if reduction != "none":
            return losses
        return losses.new_zeros(labels.numel()).index_copy(0, rows, losses[:rows.numel()]).view(labels.shape)

    @property
    def loss_fn(self):
        """(what ``forward`` returned, labels) -> the mean cross entropy (``token_loss``'s)."""
        return functools.partial(self.token_loss, reduction="mean")

    def _build_loss_fn(self, reduction: str):
        c = self.job.compile
        if self.job.training.loss_chunks is not None:
            return functools.partial(self._head_loss, reduction=reduction)
        plain = _PLAIN_LOSSES[reduction]
        if c.enable and "loss" in c.components:
            return compile_loss(plain, backend=c.backend)
        return plain

    def _head_loss(self, h: torch.Tensor, labels: torch.Tensor, reduction: str = "mean",
                   chunks: Optional[int] = None) -> torch.Tensor:
        """The head and the cross entropy over ``training.loss_chunks`` chunks of the tokens (or
        ``chunks``), in the forward's precision; one call of the head, standalone after the model's
        forward (FSDP2 completes the head's unit then; under PP this runs in the last stage's loss)."""
        chunks = chunks or self.job.training.loss_chunks
        with self._autocast(h.device.type):
            return self.model.output(h, labels=labels, chunks=chunks, reduction=reduction)

    # -- steps ---------------------------------------------------------------------------
    #
    # Each step hook runs the model on ``model_input(batch)`` and hands its output to
    # ``step_from_output``; under pipeline parallelism the first stage runs the model on
    # ``model_input`` and the last stage calls ``step_from_output`` on its stage's output
    # (strategies/pipeline.py). A subclass that changes a step changes ``step_from_output``.

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, records = self.step_from_output("training_step", self._batch_input(batch), batch)
        self._log_records(records)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.step_from_output("validation_step", self._batch_input(batch), batch)

    def step_from_output(self, hook: str, output: torch.Tensor,
                         batch: dict[str, torch.Tensor]) -> tuple[Optional[torch.Tensor], list[Record]]:
        """What the step hook ``hook`` does once the model returned ``output`` for ``batch``: for
        training_step, the objective's loss and what to log; for validation and test, the update of
        the held-out loss (the objective's ``eval_loss``), no loss and nothing logged."""
        if hook == "training_step":
            return self.objective.loss(output, batch)
        loss, weight = self.objective.eval_loss(output, batch)
        self.val_loss.update(loss, weight=weight)
        return None, []

    def _log_records(self, records: list[Record]) -> None:
        for name, value, options in records:
            self.log(name, value, **options)

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val", prog_bar=True)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def _log_eval(self, prefix: str, prog_bar: bool = False) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        # The metric is already the same on every rank (torchmetrics reduced it); the max over the
        # ranks returns it unchanged, and tells Lightning it is synchronized (no sync_dist warning).
        self.log(f"{prefix}/loss", loss, prog_bar=prog_bar, sync_dist=True, reduce_fx="max")
        self._log_records(self.objective.eval_records(prefix, loss, self.device_mesh))

    # -- optimization ----------------------------------------------------------------------

    def configure_optimizers(self) -> dict[str, Any]:
        # (the trainable ones: with LoRA the adapters alone, no optimizer state for a frozen base)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = build_optimizer(trainable, self.job.optimizer, self.device)
        max_steps = self.trainer.max_steps
        if max_steps is None or max_steps < 1:
            raise ValueError(f"trainer.max_steps={max_steps} must be >= 1: the LR schedule is defined in steps")
        scheduler = build_lr_scheduler(optimizer, self.job.lr_schedule, max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # MoE load balancing: move each layer's expert bias toward the under-used experts; the
        # counts are summed over the ranks that hold the same layers (one stage's under PP).
        pipeline = self._pipeline()
        if pipeline is None:
            update_expert_bias(self.model)
        else:
            update_expert_bias(self.model, pipeline.stage_group, reduce=pipeline.stage_group is not None)
        # Free the gradients now: Lightning zeroes them after the next step's forward, so they
        # would stay allocated through it (the size of the local fp32 parameters: 3.7 GiB of the
        # Llama 3 1B peak on one H200, benchmarks/RESULTS.md).
        optimizer.zero_grad(set_to_none=True)

    def _pipeline(self):
        trainer = self._trainer
        return getattr(trainer.strategy, "pipeline", None) if trainer is not None else None

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip to ``training.max_grad_norm`` and log the pre-clip global grad norm, without a host
        sync: the clip coefficient is computed on the device, and the loss and norm are checked for
        finiteness one step later (``check_finite``: at the next step's clipping, before a
        checkpoint is saved, at the end of training). So a non-finite step k stops the run at step
        k + 1 at the latest, after step k's optimizer step, and before any checkpoint of step k.

        Lightning calls this after backward and before every optimizer step.
        """
        max_norm = self.job.training.max_grad_norm
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        end = self.objective.end_step(grads, self.device, self.device_mesh)  # (the step's reductions)
        self._log_records(end.records)
        pipeline = self._pipeline()
        norm = global_grad_norm(grads, pp_group=pipeline.pp_group if pipeline is not None else None)
        step = self.trainer.global_step + 1
        self._show_in_progress_bar(self.check_finite(f"before step {step}'s optimizer step"))
        # The grad norm is reduced over every rank above: under PP a NaN loss on the last stage
        # makes every stage's norm NaN, so all ranks stop together, at the same step.
        self._unchecked = _Unchecked(step, end.losses, norm, end.tokens)
        if max_norm is not None:
            clip_grads_(grads, max_norm, norm)
        self.last_grad_norm = norm.detach()
        self.log("train/grad_norm", norm)

    def check_finite(self, where: str) -> Optional[tuple[list[float], float]]:
        """Raise FloatingPointError if the last clipped step's loss or grad norm was not finite
        (``where``: the point of the run this check stops, for the message); else return them
        (this rank's microbatch losses and the global norm, as Python numbers), or None."""
        unchecked, self._unchecked = self._unchecked, None
        return None if unchecked is None else unchecked.check(where)

    def _show_in_progress_bar(self, previous: Optional[tuple[list[float], float]]) -> None:
        """The progress bar's ``loss`` (this rank's, the mean of its microbatches) and ``grad_norm``:
        the previous step's, already on the host. Lightning turns every progress-bar value into a
        Python number after each step; a value on the GPU would make the host wait there for all
        the work queued so far, every step. (``train/loss`` and ``train/grad_norm``, each step's own
        and the loss averaged over ranks, go to the loggers and callbacks.)"""
        if previous is None:
            return
        losses, norm = previous
        if losses:
            self.log("loss", torch.tensor(sum(losses) / len(losses)), prog_bar=True, logger=False)
        self.log("grad_norm", torch.tensor(norm), prog_bar=True, logger=False)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Every save (ModelCheckpoint, preemption, Trainer.save_checkpoint) comes through here:
        # no checkpoint holds the weights of a step after a non-finite one.
        self.check_finite("before saving a checkpoint")

    def on_train_epoch_end(self) -> None:
        # (before on_train_end, where callbacks export the weights)
        self.check_finite("at the end of training")

    def on_train_end(self) -> None:
        self.check_finite("at the end of training")


class _Unchecked:
    """A step's microbatch losses and grad norm, copied to the host without waiting: read one step
    later, when the device has long computed them (on CUDA an event marks the copy)."""

    def __init__(self, step: int, losses: list[torch.Tensor], norm: torch.Tensor,
                 tokens: Optional[torch.Tensor] = None) -> None:
        self.step, self.losses, self.counts_tokens = step, len(losses), tokens is not None
        extra = [tokens.to(norm).reshape(())] if tokens is not None else []
        values = torch.stack([v.to(norm).reshape(()) for v in losses] + [norm.detach()] + extra)
        self.event = None
        if values.device.type == "cuda":
            self.values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.values.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.values = values

    def check(self, where: str) -> tuple[list[float], float]:
        if self.event is not None:
            self.event.synchronize()  # waits for this step's copy only, not for the work queued since
        *losses, norm = self.values.tolist()
        if self.counts_tokens:
            norm, tokens = losses.pop(), norm
            if tokens == 0:
                raise ValueError(
                    f"step {self.step} had no supervised token on any rank (data.sft: every label of its batches is "
                    f"masked), so it had no loss to learn from; stopping {where}. Check the loss masks of the data "
                    f"(titan-lightning prepare --train-on, --max-tokens)"
                )
        for value in losses:
            if not math.isfinite(value):
                raise FloatingPointError(f"non-finite training loss {value} at step {self.step}; stopping {where}")
        if not math.isfinite(norm):
            raise FloatingPointError(f"non-finite gradient norm {norm} at step {self.step}; stopping {where}")
        return losses, norm
