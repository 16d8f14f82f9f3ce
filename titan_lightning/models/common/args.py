"""The architecture fields most families share (``DecoderArgs``).

Qwen 2 / 3, Mistral / Mixtral, Phi-3, OLMo 2 and Gemma 3 are grouped-query decoders with a head
size of their own, a gated MLP of ``ffn_hidden_dim``, RMSNorm and RoPE: their args subclass this,
redeclaring only the defaults that differ (a redeclared field keeps its place in the field order)
and adding what is theirs. Llama 3 (its MLP width derived from ``dim``) and DeepSeek V3 (latent
attention) keep their own; gpt-oss (MoE only) too.
"""

from dataclasses import dataclass

from titan_lightning.config.job import ModelArgs


@dataclass(kw_only=True)
class DecoderArgs(ModelArgs):
    """Grouped-query decoder shape; the defaults are the debug models' (torchtitan's debugmodel:
    dim 256, 16 heads, vocab 2048) with 8 key/value heads."""

    n_kv_heads: int = 8
    dim: int = 256
    n_layers: int = 6
    # Features of each head (Hugging Face ``head_dim``; dim // n_heads in most published sizes).
    head_dim: int = 16
    # Width of the gated MLP (Hugging Face ``intermediate_size``); unused by MoE blocks.
    ffn_hidden_dim: int = 768
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 4096
    # std of wo/w2/w3 (and a router): 0.02 / sqrt(2 * (layer_id + 1)) if True, else 0.02 / sqrt(2 * n_layers).
    depth_init: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_positive_ints("dim", "n_layers", "head_dim", "ffn_hidden_dim", "max_seq_len")
        self.require_positive("norm_eps", "rope_theta")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even (RoPE rotates pairs of features)")
        moe = getattr(self, "moe", None)  # a family's mixture of experts (Qwen3-MoE, Mixtral), checked with the rest
        if moe is not None:
            moe.__post_init__()
