"""Lightning's tensor-parallel example, small, and recipes that run it under either strategy.

Rewritten (not copied) from Lightning-AI/pytorch-lightning ``examples/pytorch/tensor_parallel/``
(model.py, parallelism.py, train.py, data.py), which adapts torchtitan's Llama: what the example
does is kept, at a size a CPU test can run (dim 64, 2 layers, vocab 256, sequence 32):

- a Llama-style Transformer (RMSNorm, rotary embeddings as complex numbers, grouped-query
  attention, SwiGLU), built on the meta device (``trainer.init_module(empty_init=True)`` in the
  example) and initialized in ``on_train_start`` (``init_weights``);
- ``parallelize``: TP with sequence parallelism through ``parallelize_module`` (the embedding
  rowwise into sequence shards, the output colwise with vocab-sharded logits for loss
  parallelism, ``PrepareModuleInput`` around attention and feed-forward, the head counts made
  per-rank by hand), then FSDP2 with a bf16 ``MixedPrecisionPolicy`` and activation
  checkpointing over ``device_mesh["data_parallel"]``;
- the LightningModule: ``configure_model`` calls it, ``training_step`` computes the loss and
  ``backward`` runs under ``loss_parallel()``.

The recipes differ only in the strategy's class (``model_parallel`` / ``titan``): what the
example's users would change. Imported, through PYTHONPATH, by test_lightning_tp_example.py's workers.
"""

from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, Dataset

from titan_lightning.recipe import Run
from titan_lightning.strategies import TitanStrategy


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    hidden_dim: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 32


def rotary_table(head_dim: int, positions: int, theta: float) -> torch.Tensor:
    """e^(i * position * frequency) for each position and each pair of a head's features."""
    frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(positions).float(), frequencies)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate each pair of features of x [B, S, H, D] by its position's angle."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = pairs * table[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(rotated).flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads  # parallelize makes them per-rank
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, std=std)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = rotate(self.wq(x).view(B, S, self.n_heads, self.head_dim), table)
        k = rotate(self.wk(x).view(B, S, self.n_kv_heads, self.head_dim), table)
        v = self.wv(x).view(B, S, self.n_kv_heads, self.head_dim)
        repeats = self.n_heads // self.n_kv_heads  # each key/value head serves that many query heads
        k, v = (t.repeat_interleave(repeats, dim=2) for t in (k, v))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5  # deeper layers start smaller

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        self.feed_forward.init_weights(self.init_std)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("rope", self._rope(), persistent=True)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def _rope(self) -> torch.Tensor:
        return rotary_table(self.args.dim // self.args.n_heads, 2 * self.args.max_seq_len, self.args.rope_theta)

    def reset_parameters(self) -> None:  # (the strategy materializing the meta-device model calls it)
        self.rope = self._rope().to(self.rope.device)

    def init_weights(self) -> None:
        self.reset_parameters()
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        std = self.args.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        return self.output(self.norm(h)).float()


def parallelize(model: Transformer, device_mesh) -> Transformer:
    """TP with sequence parallelism over ``tensor_parallel``, then FSDP2 over ``data_parallel``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp_mesh, dp_mesh = device_mesh["tensor_parallel"], device_mesh["data_parallel"]
    if tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            # Logits stay sharded over the vocab: the loss is computed under loss_parallel().
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
            "norm": SequenceParallel(),
            "layers.0": PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None),
                                           use_local_output=True),
        })
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                desired_input_layouts=(Replicate(), None)),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            })
            block.attention.n_heads //= tp_mesh.size()
            block.attention.n_kv_heads //= tp_mesh.size()
    if dp_mesh.size() > 1:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer_id, block in list(model.layers.items()):
            block = checkpoint_wrapper(block)
            # The last block is gathered again right away for the backward: keep it.
            last = int(layer_id) == len(model.layers) - 1
            fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=not last)
            model.layers[layer_id] = block
        fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return model


class RandomTokens(Dataset):
    """The same random sequences on every rank (the sampler gives each data-parallel rank its part)."""

    def __init__(self, vocab_size: int, length: int, samples: int = 128) -> None:
        self.tokens = torch.randint(vocab_size, (samples, length + 1), generator=torch.Generator().manual_seed(42))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


class Llama3(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.args = ModelArgs()
        self.model = Transformer(self.args)

    def configure_model(self) -> None:
        parallelize(self.model, self.device_mesh)

    def on_train_start(self) -> None:
        self.model.init_weights()

    def training_step(self, batch):
        from torch.distributed.tensor.parallel import loss_parallel

        inputs, labels = batch[:, :-1], batch[:, 1:]
        logits = self.model(inputs)
        with loss_parallel():
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        self.log("train/loss", loss.full_tensor() if hasattr(loss, "full_tensor") else loss, sync_dist=True)
        return loss

    def backward(self, *args, **kwargs) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            super().backward(*args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3, foreach=True)

    def train_dataloader(self):
        return DataLoader(RandomTokens(self.args.vocab_size, self.args.max_seq_len), batch_size=8)


STEPS = 8


def _run(strategy) -> Run:
    with torch.device("meta"):  # what trainer.init_module(empty_init=True) does in the example
        module = Llama3()
    return Run(module=module, trainer=dict(strategy=strategy, accelerator="cpu", max_steps=STEPS, logger=False,
                                           enable_checkpointing=False, enable_progress_bar=False,
                                           enable_model_summary=False))


def model_parallel() -> Run:
    return _run(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2))


def titan() -> Run:
    return _run(TitanStrategy(data_parallel_size=2, tensor_parallel_size=2))
