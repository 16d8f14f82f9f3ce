"""Our decoders as a run builds them (on the meta device, then materialized on the CPU and
initialized from a seed), and the checks every family's model tests make of them."""

import torch

from titan_lightning.models.common.decoder import decoder_class


def meta_model(args):
    """The decoder ``args`` describe (the family's ``Transformer``), on the meta device."""
    with torch.device("meta"):
        return decoder_class(type(args))(args)


def materialized(args, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The decoder built on meta, materialized on the CPU in ``dtype`` and initialized with ``seed``."""
    model = meta_model(args).to(dtype)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def assert_causal(model, vocab_size: int) -> None:
    """Changing token 10 of 24 leaves the logits before it as they were (to 1e-6) and changes every
    one from it on (by more than 1e-3)."""
    tokens = torch.randint(0, vocab_size, (1, 24))
    changed = tokens.clone()
    changed[0, 10] = (tokens[0, 10] + 1) % vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :10], before[:, :10], rtol=0, atol=1e-6)
    assert (after[:, 10:] - before[:, 10:]).abs().amax(-1).min() > 1e-3


def reference_attention(q, k, v, window=None, documents=None, sinks=None):
    """Attention written out on [B, S, H, D] tensors: scores, a mask built entry by entry (a key j
    is seen by the query i when j <= i, i - window < j and both are in one document of ``documents``,
    [B, S] ids), softmax (with ``sinks``, [H], as one more column), values."""
    B, S, H, D = q.shape
    k, v = (t.repeat_interleave(H // t.shape[2], dim=2) for t in (k, v))
    docs = torch.zeros(B, S, dtype=torch.long) if documents is None else documents
    allowed = torch.tensor([[[j <= i and (window is None or i - window < j) and docs[b, i] == docs[b, j]
                              for j in range(S)] for i in range(S)] for b in range(B)])
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / D**0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is None:
        weights = scores.softmax(-1)
    else:
        column = sinks.view(1, H, 1, 1).expand(B, H, S, 1)
        weights = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("bhij,bjhd->bihd", weights, v)
