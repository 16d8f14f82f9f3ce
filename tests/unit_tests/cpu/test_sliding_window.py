"""Sliding-window attention (``model.sliding_window``, ``model.layer_types``;
models/common/masking.py): a query at i sees the keys i - W < j <= i (Hugging Face's meaning),
and with ``block_causal`` only those of its document. fp64 against an explicit reference
(1e-10), a window over the whole sequence bit for bit the full causal model, per-layer windows,
every context-parallel backend, and transformers' Mistral as the reference semantics."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from test_document_masking import FAMILIES, VOCAB, S, _documents, _model, _positions
from titan_lightning.config import ConfigError
from titan_lightning.models.common.attention import Attention
from titan_lightning.models.common.masking import attend, documents_for
from titan_lightning.models.common.rope import apply_rope

from tests.decoders import reference_attention

LENGTHS = [[5, 1, 9, 1, 12, 4], [S]]
LLAMA = FAMILIES["llama3"]


def _document_ids(lengths):
    return torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])


class _Args:  # what documents_for reads
    def __init__(self, kernel, mask, window):
        self.attention, self.mask, self.positions, self.max_seq_len = kernel, mask, "global", S
        self.sliding_window, self.layer_types = window, None


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
@pytest.mark.parametrize("mask", ["causal", "block_causal"])
def test_sliding_attention_equals_the_explicit_reference(kernel, mask):
    g = torch.Generator().manual_seed(0)
    grad = kernel == "sdpa"  # (torch has no FlexAttention backward on CPU: tests/unit_tests/gpu/ checks it)
    q, k, v = (torch.randn(2, S, h, 8, generator=g, dtype=torch.float64, requires_grad=grad) for h in (4, 2, 2))
    ids = _document_ids(LENGTHS) if mask == "block_causal" else None
    for window in (1, 3, 8, S - 1):
        documents = documents_for(_Args(kernel, mask, window), _positions(LENGTHS), q)
        out = attend(q, k, v, documents, window=window)
        expected = reference_attention(q, k, v, window, ids)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10, msg=f"window {window}")
        if grad:
            w = torch.randn_like(out)
            grads = torch.autograd.grad((out * w).sum(), (q, k, v))
            for name, a, b in zip("qkv", grads, torch.autograd.grad((expected * w).sum(), (q, k, v))):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=f"d{name}, window {window}")
        full = attend(q, k, v, documents)  # this batch's full layers: no window
        torch.testing.assert_close(full, reference_attention(q, k, v, None, ids), rtol=0, atol=1e-10)


@pytest.mark.parametrize("mask", ["causal", "block_causal"])
def test_a_window_over_the_whole_sequence_is_full_causal_bit_for_bit(mask):
    full = _model(LLAMA, mask=mask)
    tokens = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(1))
    expected = full(tokens, _positions(LENGTHS))
    for window in (S, S + 7):
        sliding = _model(LLAMA, mask=mask, sliding_window=window)
        assert torch.equal(sliding(tokens, _positions(LENGTHS)), expected)
    narrow = _model(LLAMA, mask=mask, sliding_window=S - 1)  # (and a window shorter than that is not)
    assert not torch.allclose(narrow(tokens, _positions(LENGTHS)), expected)


def test_a_packed_sliding_window_computes_each_document_with_its_own_window():
    window = 4  # shorter than most documents, longer than some
    packed = _model(LLAMA, mask="block_causal", positions="per_document", sliding_window=window)
    alone = _model(LLAMA, sliding_window=window)
    alone.load_state_dict(packed.state_dict())
    tokens = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(2))
    logits = packed(tokens, _positions(LENGTHS))
    logits.square().sum().backward()
    for b, start, n in _documents(LENGTHS):
        out = alone(tokens[b:b + 1, start:start + n])
        torch.testing.assert_close(logits[b:b + 1, start:start + n], out, rtol=0, atol=1e-10)
        out.square().sum().backward()
    for (name, p), q in zip(packed.named_parameters(), alone.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10, msg=name)


def _attention_reference(module: Attention, x, rope_cache, window, documents=None):
    B, S_, _ = x.shape
    q, k, v = (w(x).view(B, S_, -1, module.head_dim) for w in (module.wq, module.wk, module.wv))
    rope = rope_cache[:S_]
    attended = reference_attention(apply_rope(q, rope), apply_rope(k, rope), v, window, documents)
    return module.wo(attended.reshape(B, S_, -1))


@pytest.mark.parametrize("family, kernel", [("llama3", "sdpa"), ("llama3", "flex"), ("qwen3_moe", "sdpa")])
def test_alternating_layer_types_give_each_layer_its_window(family, kernel):
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    model = _model(FAMILIES[family], n_layers=3, sliding_window=5, layer_types=types, mask="block_causal",
                   attention=kernel)
    assert [layer.attention.window for layer in model.layers.values()] == [5, None, 5]
    seen = []
    for layer in model.layers.values():
        layer.attention.register_forward_hook(lambda m, args, out: seen.append((m, args[0], out)))
    with torch.no_grad():  # (flex: forward only on CPU)
        model(torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(3)), _positions(LENGTHS))
    for (module, x, out), kind in zip(seen, types):
        window = 5 if kind == "sliding_attention" else None
        if module.q_norm is not None:  # (Qwen 3's QK-norm: the reference then norms too)
            module.wq = torch.nn.Sequential(module.wq, torch.nn.Unflatten(-1, (-1, module.head_dim)), module.q_norm,
                                            torch.nn.Flatten(-2))
            module.wk = torch.nn.Sequential(module.wk, torch.nn.Unflatten(-1, (-1, module.head_dim)), module.k_norm,
                                            torch.nn.Flatten(-2))
        with torch.no_grad():
            expected = _attention_reference(module, x, model.rope_cache, window, _document_ids(LENGTHS))
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-10, msg=kind)


def test_every_layer_slides_when_layer_types_is_none_and_none_without_a_window():
    assert [l.attention.window for l in _model(LLAMA, sliding_window=6).layers.values()] == [6, 6]
    assert [l.attention.window for l in _model(LLAMA, layer_types=["full_attention"] * 2).layers.values()] == [None] * 2


def test_an_attention_without_a_window_refuses_one():
    with pytest.raises(ValueError, match="model.sliding_window=4: MultiHeadLatentAttention has no sliding window"):
        _model(FAMILIES["deepseek_v3"], sliding_window=4)


def test_bad_window_settings_are_one_line():
    from recipes.tests import features
    from titan_lightning.config import validate_job
    from titan_lightning.models.llama3 import Llama3Args

    with pytest.raises(ValueError, match="model.sliding_window=0 must be a positive integer"):
        Llama3Args(sliding_window=0)
    with pytest.raises(ValueError, match="model.layer_types has 'local', which is not one of full_attention, "
                                         "sliding_attention"):
        Llama3Args(layer_types=["local"])
    job = features.llama3_fsdp2().job
    n = job.model.n_layers
    job.model.layer_types = ["sliding_attention"] * (n + 1)
    job.model.sliding_window = 8
    with pytest.raises(ConfigError, match=f"model.layer_types lists {n + 1} layers, but model.n_layers={n}"):
        validate_job(job, world_size=2)
    job.model.layer_types, job.model.sliding_window = ["sliding_attention"] * n, None
    with pytest.raises(ConfigError, match="model.layer_types has 'sliding_attention' layers but "
                                          "model.sliding_window=None"):
        validate_job(job, world_size=2)
    job.model.sliding_window = 8
    validate_job(job, world_size=2)
    for layout in (features.llama3_cp2, features.llama3_cp2_ring, features.llama3_cp2_ulysses):  # every CP backend
        job = layout().job
        job.model.sliding_window, job.model.mask = 8, "block_causal"
        validate_job(job, world_size=2)


def test_varlen_with_a_window_is_refused_where_varlen_attn_has_no_window_size(monkeypatch):
    import torch.nn.attention.varlen as varlen

    from recipes.tests import features
    from titan_lightning.config import validate_job

    def job():
        job = features.llama3_fsdp2().job
        job.model.attention, job.model.sliding_window = "varlen", 8
        job.training.mixed_precision_param = "bfloat16"  # (varlen computes in bf16 only)
        return job

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))  # (the GPU it would run on)
    validate_job(job(), world_size=2, device_type="cuda")  # torch 2.13's has it
    monkeypatch.setattr(varlen, "varlen_attn", lambda q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None: q)
    with pytest.raises(ConfigError, match="model.sliding_window=8 with model.attention='varlen' needs varlen_attn's "
                                          "window_size, which torch .* lacks: use 'flex' or 'sdpa'"):
        validate_job(job(), world_size=2, device_type="cuda")


# -- context parallelism ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["allgather", "ring", "ulysses"])
@pytest.mark.parametrize("documents", [None, LENGTHS], ids=["causal", "block_causal"])
def test_every_cp_backend_computes_the_sliding_window_exactly(backend, documents):
    from cp_cases import attention_parity
    from titan_lightning.testing.threaded import run_threaded

    for window in (3, 11):  # within a chunk (8 tokens at cp 2, headtail), across chunks and ranks
        for errors in run_threaded(attention_parity, 2, backend=backend, load_balancer="headtail", n_heads=4,
                                   n_kv_heads=2, seq_len=S, documents=documents, window=window):
            assert all(errors[name] < 1e-10 for name in ("out", "dq", "dk", "dv")), (window, errors)


@pytest.mark.multi_process
def test_cp2_allgather_on_gloo_ranks_equals_one_process(tmp_path):
    from pathlib import Path

    from titan_lightning.testing.launch import pythonpath_env
    from titan_lightning.testing.spawn import run_function

    env = pythonpath_env(Path(__file__).parent)
    results = run_function("cp_cases:attention_parity", 2, out_dir=tmp_path, timeout=180, env=env,
                           backend="allgather", load_balancer="headtail", n_heads=4, n_kv_heads=2, seq_len=S,
                           documents=LENGTHS, window=6)
    for rank, errors in enumerate(results):
        assert all(errors[name] < 1e-10 for name in ("out", "dq", "dk", "dv")), (rank, errors)


# -- the reference semantics: transformers' Mistral -------------------------------------------


def test_mistral_with_a_sliding_window_gives_our_logits(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the reference implementation; not a project dependency")
    from test_llama3_hf_parity import save
    from test_qwen3_model import randomized
    from titan_lightning.models.llama3 import Llama3Args, Llama3StateDictAdapter, Transformer

    window, theta = 6, 10000.0
    c = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, sliding_window=window, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": theta})
    torch.manual_seed(0)
    save(randomized(transformers.MistralForCausalLM(c).float().eval()), tmp_path)
    reference = transformers.MistralForCausalLM.from_pretrained(tmp_path).float().eval()
    args = Llama3Args(vocab_size=VOCAB, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, multiple_of=64, norm_eps=1e-5,
                      rope_theta=theta, rope_scaling=None, max_seq_len=64, sliding_window=window)
    ours, full = Transformer(args), Transformer(dataclasses.replace(args, sliding_window=None))
    Llama3StateDictAdapter(args).load_into(ours, tmp_path)
    full.load_state_dict(ours.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(full(tokens), expected, atol=1e-2)  # the window matters at seq 24
