"""Document masking of packed windows (models/common/masking.py): with ``model.mask =
"block_causal"`` a packed window computes what each of its documents computes on its own, in
outputs and gradients (fp64, 1e-10), and its loss is the token-weighted mean of theirs; with
``model.positions = "per_document"`` each document sits at positions from 0."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from titan_lightning.config import ConfigError
from titan_lightning.models.common.decoder import decoder_class
from titan_lightning.models.common.moe import MoEArgs
from titan_lightning.models.deepseek_v3 import DeepSeekV3Args
from titan_lightning.models.llama3 import Llama3Args
from titan_lightning.models.qwen3 import Qwen3Args

VOCAB, S = 64, 32
FAMILIES = {
    "llama3": Llama3Args(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64),
    "qwen3_moe": Qwen3Args(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=64,
                           ffn_hidden_dim=48, moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=16, load_balance_coeff=None)),
    "deepseek_v3": DeepSeekV3Args(vocab_size=VOCAB, dim=32, n_layers=2, n_dense_layers=1, n_heads=4, n_kv_heads=4,
                                  inter_dim=64, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                  max_seq_len=64, original_seq_len=64,
                                  moe=MoEArgs(num_experts=4, top_k=2, hidden_dim=16, num_shared_experts=1,
                                              score_func="sigmoid", load_balance_coeff=None)),
}
# Row 0: documents of random lengths including length 1; row 1: one document filling the window.
LENGTHS = [[5, 1, 9, 1, 12, 4], [S]]


def _model(args, **changes):
    args = dataclasses.replace(args, **changes)
    torch.manual_seed(0)
    model = decoder_class(type(args))(args)
    model.init_weights(seed=0)
    return model.double()


def _positions(lengths) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


def _documents(lengths):
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            yield b, start, n
            start += n


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_window_computes_each_document_on_its_own(family):
    packed = _model(FAMILIES[family], mask="block_causal", positions="per_document")
    alone = _model(FAMILIES[family])  # causal, global positions: a document from position 0
    alone.load_state_dict(packed.state_dict())
    tokens = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(2))
    logits = packed(tokens, _positions(LENGTHS))
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    total, losses = 0, []
    for b, start, n in _documents(LENGTHS):
        out = alone(tokens[b:b + 1, start:start + n])
        torch.testing.assert_close(logits[b:b + 1, start:start + n], out, rtol=0, atol=1e-10)
        doc_loss = F.cross_entropy(out.flatten(0, 1), labels[b, start:start + n])
        losses.append((doc_loss, n))
        total += n
    reference = sum(l * n for l, n in losses) / total  # the token-weighted mean of the documents' losses
    assert math.isclose(loss.item(), reference.item(), rel_tol=1e-12)
    reference.backward()
    for (name, p), q in zip(packed.named_parameters(), alone.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_global_positions_keep_each_document_where_it_is_in_the_window(family):
    packed = _model(FAMILIES[family], mask="block_causal")
    per_token = _model(FAMILIES[family], positions="per_document")
    per_token.load_state_dict(packed.state_dict())
    tokens = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(3))
    logits = packed(tokens, _positions(LENGTHS))
    for b, start, n in _documents(LENGTHS):
        # On its own, causal, at positions start..start+n-1 (no 0 among them: one document).
        at = torch.arange(start, start + n)[None] if start else torch.arange(n)[None]
        torch.testing.assert_close(logits[b:b + 1, start:start + n], per_token(tokens[b:b + 1, start:start + n], at),
                                   rtol=0, atol=1e-10)


def test_the_causal_default_reads_no_positions_and_equals_block_causal_on_one_document():
    causal = _model(FAMILIES["llama3"])
    masked = _model(FAMILIES["llama3"], mask="block_causal", positions="per_document")
    tokens = torch.randint(0, VOCAB, (1, S))
    torch.testing.assert_close(causal(tokens), masked(tokens, torch.arange(S)[None]), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="model.mask='block_causal', model.positions='per_document' need the batch's position_ids"):
        masked(tokens)


def test_bad_settings_are_one_line():
    from recipes.tests import features
    from titan_lightning.config import validate_job

    with pytest.raises(ValueError, match="model.mask='block' is not one of causal, block_causal"):
        Llama3Args(mask="block")
    with pytest.raises(ValueError, match="model.positions='local' is not one of global, per_document"):
        Llama3Args(positions="local")
    for layout in (features.llama3_cp2, features.llama3_cp2_ring, features.llama3_cp2_ulysses):  # every CP backend masks
        job = layout().job
        job.model.mask = "block_causal"
        validate_job(job, world_size=2)


# -- kernels ------------------------------------------------------------------------------------
# FlexAttention runs forward only on CPU (torch has no backward there): outputs here, gradients
# in tests/unit_tests/gpu/test_document_masking_gpu.py. varlen is CUDA only: its offsets here.


@pytest.mark.parametrize("family", FAMILIES)
def test_flex_computes_each_document_on_its_own(family):
    packed = _model(FAMILIES[family], attention="flex", mask="block_causal", positions="per_document")
    alone = _model(FAMILIES[family])
    alone.load_state_dict(packed.state_dict())
    tokens = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = packed(tokens, _positions(LENGTHS))
        for b, start, n in _documents(LENGTHS):
            torch.testing.assert_close(logits[b:b + 1, start:start + n], alone(tokens[b:b + 1, start:start + n]),
                                       rtol=0, atol=1e-10)


def test_flex_causal_equals_sdpa_causal_without_positions():
    sdpa = _model(FAMILIES["llama3"])
    flex = _model(FAMILIES["llama3"], attention="flex")
    tokens = torch.randint(0, VOCAB, (2, S))
    with torch.no_grad():
        torch.testing.assert_close(flex(tokens), sdpa(tokens), rtol=0, atol=1e-10)


def test_varlen_offsets_are_the_documents_of_the_flattened_batch():
    from titan_lightning.models.common.masking import varlen_offsets

    cu, longest = varlen_offsets(_positions(LENGTHS), 2, S, "cpu")
    lengths = [n for row in LENGTHS for n in row]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert longest == max(lengths)
    # A row that starts inside a document (no 0 at its first token) still starts one.
    cu, _ = varlen_offsets(torch.tensor([[0, 1, 2, 3], [7, 8, 0, 1]]), 2, 4, "cpu")
    assert cu.tolist() == [0, 4, 6, 8]
    cu, longest = varlen_offsets(None, 3, 4, "cpu")  # causal: one document per row
    assert cu.tolist() == [0, 4, 8, 12] and longest == 4


def test_skipped_block_share_counts_the_causal_tiles_a_block_mask_leaves_out():
    from titan_lightning.models.common.masking import flex_block_mask, skipped_block_share

    S_, block = 512, 128  # 4 x 4 tiles, 10 at or below the diagonal
    one_document = flex_block_mask(torch.arange(S_)[None], 1, S_, "cpu")
    assert skipped_block_share(one_document) == 0.0
    four = flex_block_mask(torch.arange(S_)[None] % block, 1, S_, "cpu")  # a document per tile row
    assert skipped_block_share(four) == pytest.approx(1 - 4 / 10)


def test_kernels_are_refused_where_they_cannot_train():
    from recipes.tests import features
    from titan_lightning.config import validate_job

    job = features.llama3_fsdp2().job  # dp_shard 2
    job.model.attention = "varlen"
    with pytest.raises(ConfigError, match="model.attention='varlen' runs FlashAttention on CUDA only, and this run "
                                          "is on 'cpu'"):
        validate_job(job, world_size=2, device_type="cpu")
    job.model.attention = "flex"
    with pytest.raises(ConfigError, match="model.attention='flex' cannot train on 'cpu'"):
        validate_job(job, world_size=2, device_type="cpu")
    validate_job(job, world_size=2, device_type="cuda")
    job = features.llama3_cp2().job
    job.model.attention = "flex"
    with pytest.raises(ConfigError, match="parallelism.cp=2 needs a context-parallel attention, but "
                                          "model.attention='flex'"):
        validate_job(job, world_size=2)
