"""Tiny Hugging Face model folders as users hold them: saved by transformers (config.json,
safetensors), with a tokenizer.json trained here and a tokenizer_config.json in the special-token
layout of the family (Llama 3: <|begin_of_text|> / <|end_of_text|>, Qwen 2 / 3: <|endoftext|> only,
DeepSeek: <｜begin▁of▁sentence｜> / <｜end▁of▁sentence｜>, Mistral / Mixtral: <s> / </s>, gpt-oss:
<|startoftext|> / <|return|>, Gemma 3: <bos> / <eos>, Phi-3: <s> / <|endoftext|>, OLMo 2: <|endoftext|>
only). Needs transformers."""

import inspect
import json
from pathlib import Path

import torch

VOCAB = 320  # the model's; the tokenizer has fewer (byte-level BPE: 256 bytes + merges + specials)
SHAPES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-6)
SPECIAL_TOKENS = {
    "llama": ("<|begin_of_text|>", "<|end_of_text|>"),
    "qwen2": (None, "<|endoftext|>"),
    "qwen3": (None, "<|endoftext|>"),
    "qwen3_moe": (None, "<|endoftext|>"),
    "deepseek_v3": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "mistral": ("<s>", "</s>"),
    "mixtral": ("<s>", "</s>"),
    "gpt_oss": ("<|startoftext|>", "<|return|>"),
    "gemma3_text": ("<bos>", "<eos>"),
    "gemma3": ("<bos>", "<eos>"),
    "phi3": ("<s>", "<|endoftext|>"),
    "olmo2": (None, "<|endoftext|>"),
}
# gpt-oss's YaRN (factor 32 over 4096 positions, as published) scaled to the tiny model's 64 positions.
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": 16, "truncate": False}


def hf_config(model_type: str, tie: bool = False, **overrides):
    import transformers

    if model_type == "gemma3":  # multimodal: gemma3_text's model as its text_config, a one-layer vision tower
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14)
        return transformers.Gemma3Config(text_config=hf_config("gemma3_text", tie, **overrides).to_dict(),
                                         vision_config=vision.to_dict(), mm_tokens_per_image=4, tie_word_embeddings=tie)

    common = {**SHAPES, "tie_word_embeddings": tie, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    families = {
        "llama": (transformers.LlamaConfig, dict(intermediate_size=160)),
        "qwen2": (transformers.Qwen2Config, dict(intermediate_size=96)),
        # head_dim 32 != hidden_size / num_attention_heads = 16, as in Mistral Nemo; no sliding window.
        "mistral": (transformers.MistralConfig, dict(intermediate_size=96, head_dim=32, sliding_window=None)),
        "mixtral": (transformers.MixtralConfig, dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                                     sliding_window=None)),
        # Partial rotation (3/4 of each head, as Phi-4-mini); fused qkv_proj and gate_up_proj.
        "phi3": (transformers.Phi3Config, dict(intermediate_size=96, partial_rotary_factor=0.75, pad_token_id=None,
                                              eos_token_id=None, bos_token_id=None)),
        "olmo2": (transformers.Olmo2Config, dict(intermediate_size=96, pad_token_id=None, eos_token_id=None)),
        "qwen3": (transformers.Qwen3Config, dict(intermediate_size=96, head_dim=32)),
        "qwen3_moe": (transformers.Qwen3MoeConfig, dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                                        num_experts_per_tok=2, norm_topk_prob=True)),
        "deepseek_v3": (transformers.DeepseekV3Config, dict(
            num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
            kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            routed_scaling_factor=1.0)),
        # Sliding (window 8) and full layers alternating, YaRN, 8 experts top-2, head_dim 32 != 64 / 4.
        "gpt_oss": (transformers.GptOssConfig, dict(
            intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=32, sliding_window=8,
            rope_parameters=GPT_OSS_YARN)),
        # A sliding layer (window 6) and a global one, each with its RoPE base (the global one linearly
        # scaled, as from 4B on); scores scaled by 24 ** -0.5, not head_dim's 32 ** -0.5.
        "gemma3_text": (transformers.Gemma3TextConfig, dict(
            intermediate_size=96, head_dim=32, query_pre_attn_scalar=24, sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    }
    config_class, shapes = families[model_type]
    return config_class(**{**common, **shapes, **overrides})


def train_tokenizer(folder: Path, model_type: str) -> None:
    """tokenizer.json (byte-level BPE on the shipped corpus, < VOCAB ids) and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from titan_lightning.data.dataset import split_documents
    from titan_lightning.data.tokenizer import reference_documents

    bos, eos = SPECIAL_TOKENS[model_type]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [t for t in (bos, eos) if t]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    train, _ = split_documents(reference_documents()[:200], 0.05)
    tokenizer.train_from_iterator(train, trainer=trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "model_max_length": 64}
    if bos:
        config["bos_token"] = bos
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def save_hf_model(folder: Path, model_type: str, tie: bool = False, seed: int = 0, **overrides):
    """A random fp32 model of ``model_type`` saved by transformers into ``folder`` (no tokenizer); the model."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(model_type, tie, **overrides)).float()
    with torch.no_grad():  # O(1) logits and norms away from one, so a wrong mapping shows
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    kwargs = {}
    if "save_original_format" in inspect.signature(model.save_pretrained).parameters:
        kwargs["save_original_format"] = True  # per-expert keys, as on the Hub
    model.save_pretrained(folder, **kwargs)
    return model.eval()


def save_hf_folder(folder: Path, model_type: str, tie: bool = False, seed: int = 0, **overrides) -> Path:
    """A random model of ``model_type`` saved by transformers, with a tokenizer, into ``folder``."""
    save_hf_model(folder, model_type, tie, seed, **overrides)
    train_tokenizer(folder, model_type)
    return folder


def folder_and_conversations(root: Path, model_type: str, **overrides) -> tuple[Path, Path]:
    """``save_hf_folder(root / "hf", ...)``, and 16 conversations of 10 to 60 tokens in its tokenizer
    (the second half of each the answer) as SFT shards in ``root / "sft"``."""
    import numpy as np

    from titan_lightning.data.shards import tokenizer_identity
    from titan_lightning.data.tokenizer import load_tokenizer
    from titan_lightning.testing.sft_shards import write_sft_shards

    folder = save_hf_folder(root / "hf", model_type, **overrides)
    tokenizer = load_tokenizer(str(folder))
    rng = np.random.default_rng(0)
    conversations = []
    for length in rng.integers(10, 60, 16):
        tokens = rng.integers(1, tokenizer.vocab_size - 1, length)
        tokens[-1] = tokenizer.eot_id
        conversations.append((tokens, (np.arange(length) >= length // 2).astype(np.uint8)))
    identity = tokenizer_identity(folder / "tokenizer.json", tokenizer.vocab_size, tokenizer.eot_id, None)
    return folder, write_sft_shards(root / "sft", conversations, tokenizer=identity)


def load_ours(folder: Path):
    """Our decoder of the folder's family, its args read from config.json (as ``recipes.hf:pretrained``
    reads them), the weights loaded through the family's adapter; in eval mode, fp32."""
    from titan_lightning.models.common.decoder import decoder_class
    from titan_lightning.pretrained import read_hf_model

    hf = read_hf_model(folder)
    model = decoder_class(type(hf.args))(hf.args)
    model.init_weights(seed=1)  # overwritten by the load
    hf.module_class.hf_adapter(hf.args, tie_word_embeddings=hf.tie_word_embeddings).load_into(model, folder)
    return model.eval()


def export_hf(model, adapter_class: type, folder: Path) -> Path:
    """``model`` saved through ``adapter_class`` (in several shards, with an index) with the config.json
    an export writes; the folder."""
    adapter = adapter_class(model.args)
    adapter.save_from(model, folder, max_shard_bytes=60_000)
    (folder / "config.json").write_text(json.dumps(adapter.hf_config(model.args)))
    return folder


def load_in_transformers(folder: Path):
    """The folder's model as transformers loads it (fp32, eval)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def assert_transformers_agrees(export: Path, ours, tokens: torch.Tensor, *, rtol: float, atol: float):
    """``export`` loaded by transformers computes our model's logits of ``tokens``; the transformers model."""
    theirs = load_in_transformers(export)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(input_ids=tokens).logits, rtol=rtol, atol=atol)
    return theirs
