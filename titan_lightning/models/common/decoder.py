"""The decoder every family shares: token embeddings, pre-norm blocks, final norm, untied head.

A family subclasses ``Decoder`` and declares what differs: its args class, its tensor-parallel
plan (``plan``), and where they are not the grouped-query default (models/common/args.py's
``DecoderArgs``: ``head_dim``-wide heads, a SwiGLU or ``args.moe``, plain RoPE at ``rope_theta``)
its block's attention (``build_attention``) or whole block (``build_block``), its RoPE table, the
parameter groups of its init and its FLOP terms. The rest (the module names that FSDP grouping,
pipeline splitting and the TP plans rely on, the forward, the name-seeded init) is here once.

Build a decoder on the meta device, shard it, then ``to_empty(device=...)`` and
``init_weights(seed)``. ``layers`` is a ModuleDict keyed "0", "1", ... so a pipeline stage
can delete blocks and keep the names; a stage may also set ``tok_embeddings``, ``norm`` or
``output`` to None, and then takes or returns hidden states [B, S, dim].

``rope_cache`` is a non-persistent float32 buffer rebuilt by ``init_weights``; casting the
whole model to bfloat16 afterwards would round it too.
"""

from typing import ClassVar, Collection, Optional

import torch
from torch import nn

from titan_lightning.config.job import ModelArgs
from titan_lightning.models.common.attention import Attention
from titan_lightning.models.common.feedforward import FeedForward
from titan_lightning.models.common.init import init_params
from titan_lightning.models.common.loss import linear_cross_entropy
from titan_lightning.models.common.masking import Documents, documents_for
from titan_lightning.models.common.moe import MoE, reset_moe_buffers
from titan_lightning.models.common.norms import RMSNorm
from titan_lightning.models.common.rope import precompute_rope_cache

# The plan entries of the decoder skeleton (parallel/tensor_styles.py styles), around a family's
# attention entries: embeddings and head split over the vocab, norms on the sequence shard
# (sequence parallelism), each block input gathered, the SwiGLU split column- then row-wise.
SKELETON_TP_PLAN: dict[str, str] = {
    "tok_embeddings": "embedding",
    "layers.*.attention_norm": "norm",
    "layers.*.attention": "prepare_block_input",
}
FEED_FORWARD_TP_PLAN: dict[str, str] = {
    "layers.*.ffn_norm": "norm",
    "layers.*.feed_forward": "prepare_block_input",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "layers.*.feed_forward.w3": "colwise",
    "norm": "norm",
    "output": "output",
}


def decoder_tp_plan(attention: dict[str, str], *extra: dict[str, str]) -> dict[str, str]:
    """The whole plan: the skeleton's entries with ``attention``'s (names inside
    ``layers.*.attention``) in between, then ``extra`` (e.g. MoE entries)."""
    entries = {f"layers.*.attention.{name}": style for name, style in attention.items()}
    plan = {**SKELETON_TP_PLAN, **entries, **FEED_FORWARD_TP_PLAN}
    for more in extra:
        plan.update(more)
    return plan


def decoder_class(args_class: type) -> Optional[type["Decoder"]]:
    """The Decoder subclass built from ``args_class`` (or the nearest of its bases that has one)."""
    return next((Decoder.registry[c] for c in args_class.__mro__ if c in Decoder.registry), None)


class Block(nn.Module):
    """Pre-norm ``attention``, then ``ffn`` (a dense SwiGLU or an MoE) in the ``feed_forward`` or
    the ``moe`` slot. The other slot is kept as None so one tensor-parallel plan names both, and
    a pipeline stage holding blocks of one kind only still matches the plan."""

    def __init__(self, dim: int, norm_eps: float, attention: nn.Module, ffn: nn.Module):
        super().__init__()
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, norm_eps)
        moe = isinstance(ffn, MoE)
        self.add_module("feed_forward", None if moe else ffn)
        self.add_module("moe", ffn if moe else None)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, *, documents: Optional[Documents] = None) -> torch.Tensor:
        # Keyword-only, so tensor parallelism's PrepareModuleInput (one layout per positional
        # input) sees the same inputs whether or not a batch carries documents.
        h = x + self.attention(self.attention_norm(x), rope_cache, **_documents(documents))
        ffn = self.feed_forward if self.feed_forward is not None else self.moe
        return h + ffn(self.ffn_norm(h))


def _documents(documents: Optional[Documents]) -> dict:
    """The keyword a block or attention takes only when there are documents (a custom block
    written for the causal default keeps its two inputs)."""
    return {} if documents is None else {"documents": documents}


def _set_window(block: nn.Module, window: Optional[int]) -> None:
    """Give ``block``'s attention its sliding window (``ModelArgs.sliding_window``, ``layer_types``);
    one-line error for an attention that has none."""
    attention = getattr(block, "attention", None)
    if hasattr(attention, "window"):
        attention.window = window
    elif window is not None:
        raise ValueError(f"model.sliding_window={window}: {type(attention).__name__} has no sliding window; "
                         f"set model.sliding_window=None")


class Head(nn.Linear):
    """The output projection (no bias): logits; or, given ``labels``, their mean cross entropy
    computed ``chunks`` token rows at a time, never holding the full logits
    (models/common/loss.py). One call either way, so FSDP's and TP's hooks on the head run
    once; pass ``labels`` by keyword (TP's input hook keeps only the first positional input).
    ``softcap`` (Gemma's ``final_logit_softcapping``): logits ``tanh(logits / softcap) * softcap``."""

    def __init__(self, dim: int, vocab_size: int, softcap: Optional[float] = None) -> None:
        super().__init__(dim, vocab_size, bias=False)
        self.softcap = softcap

    def forward(self, h: torch.Tensor, labels: Optional[torch.Tensor] = None, chunks: int = 1,
                reduction: str = "mean") -> torch.Tensor:
        if labels is None:
            logits = super().forward(h)
            return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap
        return linear_cross_entropy(h, self.weight, labels, chunks=chunks, reduction=reduction, softcap=self.softcap)


class Decoder(nn.Module):
    """A causal decoder; see the module docstring. Subclasses set ``args_class`` (and ``plan``),
    and may override ``build_attention``, ``build_block``, ``build_rope_cache``, ``tp_plan`` and
    ``count_parameters``."""

    args_class: ClassVar[type] = ModelArgs
    # The family's tensor-parallel plan (its parallelize.py's TP_PLAN); None: none declared.
    plan: ClassVar[Optional[dict[str, str]]] = None
    # Parameter groups of the init, by name suffix: drawn with std 0.02, or 0.02 / sqrt(2 *
    # (layer_id + 1)) with ``args.depth_init`` (else / sqrt(2 * n_layers)); every ``*norm.weight``
    # starts at one, every bias (Qwen 2's q/k/v) at zero, the embeddings at N(0, 1), the head at
    # N(0, dim^-0.5) cut at 3 std.
    input_projections: ClassVar[tuple[str, ...]] = ("wq.weight", "wk.weight", "wv.weight", "w1.weight", "experts.w1")
    output_projections: ClassVar[tuple[str, ...]] = (
        "wo.weight", "w2.weight", "w3.weight", "experts.w2", "experts.w3", "router.gate.weight"
    )
    # True: forward stops after the final norm and the loss applies the head chunk by chunk
    # (``Head`` with labels; CausalLMModule sets it from ``training.loss_chunks``).
    head_in_loss: bool = False
    # False: the family's attention has no sliding window (DeepSeek's MLA); a job that sets
    # model.sliding_window is refused before launch (CausalLMModule.check_config).
    sliding_window: ClassVar[bool] = True
    # Decoder classes by args class: CausalLMModule builds the one its job's args ask for.
    registry: ClassVar[dict[type, type["Decoder"]]] = {}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "args_class" in cls.__dict__:  # (a subclass that keeps its parent's args does not take them over)
            Decoder.registry[cls.args_class] = cls

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("rope_cache", self.build_rope_cache(), persistent=False)
        self.layers = nn.ModuleDict({str(i): self.build_block(i) for i in range(args.n_layers)})
        for i, block in self.layers.items():
            _set_window(block, args.attention_window(int(i)))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = Head(args.dim, args.vocab_size)

    def build_block(self, layer_id: int) -> nn.Module:
        """Pre-norm ``build_attention``, then a SwiGLU of ``ffn_hidden_dim`` (``args.moe``'s MoE when set)."""
        a, moe = self.args, getattr(self.args, "moe", None)
        ffn = FeedForward(a.dim, a.ffn_hidden_dim) if moe is None else MoE(a.dim, moe)
        return Block(a.dim, a.norm_eps, self.build_attention(layer_id), ffn)

    def build_attention(self, layer_id: int) -> nn.Module:
        """Grouped-query attention of ``n_heads`` heads of ``head_dim`` features."""
        a = self.args
        return Attention(a.dim, a.n_heads, a.n_kv_heads, a.attention, head_dim=a.head_dim)

    def build_rope_cache(self) -> torch.Tensor:
        """(cos, sin) for every position, [max_seq_len, rotated features // 2, 2] float32: plain RoPE
        over ``head_dim`` features at ``rope_theta``."""
        a = self.args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta)

    @classmethod
    def tp_plan(cls, args: ModelArgs) -> Optional[dict[str, str]]:
        """Module-name patterns (relative to the decoder) -> tensor-parallel style names."""
        return None if cls.plan is None else dict(cls.plan)

    @classmethod
    def count_parameters(cls, args: ModelArgs, *, active: bool = False) -> int:
        """Parameters of ``cls(args)``; ``active``: those one token computes with (a routed
        ``MoE``'s experts counted ``top_k`` times of ``num_experts``). The default builds the model
        on the meta device (nothing allocated) and counts; the families count by arithmetic."""
        with torch.device("meta"):
            model = cls(args)
        total = sum(p.numel() for p in model.parameters())
        if active:
            for moe in (m for m in model.modules() if isinstance(m, MoE)):
                experts, m = sum(p.numel() for p in moe.experts.parameters()), moe.args
                total -= experts // m.num_experts * (m.num_experts - m.top_k)
        return total

    @classmethod
    def flop_terms(cls, args: ModelArgs) -> tuple[int, int]:
        """(parameters a token multiplies with, layers x heads x (d_qk + d_v)); see
        ``CausalLMModule.flops_per_token``. The default is for RoPE attention with equal q/k/v
        head dims (``args.head_dim``, else ``Attention``'s default ``dim // n_heads``)."""
        matmul = cls.count_parameters(args, active=True) - args.vocab_size * args.dim
        head_dim = getattr(args, "head_dim", None) or args.dim // args.n_heads
        return matmul, args.n_layers * args.n_heads * 2 * head_dim

    def forward(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None, *,
                varlen_offsets: Optional[tuple[torch.Tensor, int]] = None,
                label_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab_size], in the dtype of the parameters; with
        ``head_in_loss``, the final norm's hidden states [B, S, dim] instead (the loss then calls
        ``output(h, labels=...)``). ``position_ids`` [B, S] (each token's position in its document)
        serve ``args.mask`` / ``args.positions`` (models/common/masking.py); the defaults do not read
        them. A pipeline stage before the last (no ``output``) then hands them on with its hidden
        states. ``varlen_offsets``: varlen attention's (cu_seqlens, longest document) of the batch,
        when the caller computed them (on the host: no wait for the device). ``label_rows``: the
        logits of those token rows alone, [len(label_rows), vocab_size] (the head's matmul skips
        the rest: the tokens the loss does not read)."""
        documents = documents_for(self.args, position_ids, tokens, offsets=varlen_offsets)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, **_documents(documents))
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:  # (flex/varlen without boundaries build Documents too: nothing to hand on)
            return h if position_ids is None or documents is None else (h, position_ids)
        if self.head_in_loss:
            return h
        return self.output(h if label_rows is None else h.flatten(0, -2).index_select(0, label_rows))

    def init_weights(self, seed: int, *, loaded: Collection[str] = ()) -> None:
        """Draw every parameter from (seed, its name), as in torchtitan, but those named in
        ``loaded`` (a load overwrites them before any step: CausalLMModule.materialize); zero the
        MoE buffers; rebuild ``rope_cache``."""
        init_params(self, seed, self.init_param, skip=loaded)
        reset_moe_buffers(self)
        with torch.device("cpu"):
            cache = self.build_rope_cache()
        self.rope_cache = cache.to(self.rope_cache.device)

    def init_param(self, fqn: str, w: torch.Tensor, g: torch.Generator) -> None:
        a = self.args
        if fqn == "tok_embeddings.weight":
            nn.init.normal_(w, std=1.0, generator=g)
        elif fqn == "output.weight":
            std = a.dim**-0.5
            nn.init.trunc_normal_(w, std=std, a=-3 * std, b=3 * std, generator=g)
        elif fqn.endswith("norm.weight"):
            nn.init.ones_(w)
        elif fqn.endswith(".bias"):
            nn.init.zeros_(w)
        elif fqn.endswith(self.input_projections):
            nn.init.trunc_normal_(w, std=0.02, generator=g)
        elif fqn.endswith(self.output_projections):
            depth = 2 * (int(fqn.split(".")[1]) + 1) if a.depth_init else 2 * a.n_layers
            nn.init.trunc_normal_(w, std=0.02 / depth**0.5, generator=g)
        else:
            raise ValueError(f"no init rule for parameter {fqn!r} in {type(self).__name__}")
