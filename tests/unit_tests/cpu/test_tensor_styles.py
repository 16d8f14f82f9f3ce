"""A TP style is one record (parallel/tensor_styles.py), and a user's plan is judged by what the
module's code does (parallel/tensor_plan_check.py). In process: one rank of two under the fake
process group, or no process group at all (``check_tp_plan``)."""

import textwrap

import pytest
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_lightning.config import ConfigError
from titan_lightning.parallel.tensor import apply_tp, check_tp_plan
from titan_lightning.parallel.tensor_styles import STYLES, TPStyle
from user_gpt import GPTModule

ATTENTION_ONLY = {"model.h.*.attn.qkv": "colwise_fused:3", "model.h.*.attn.proj": "rowwise"}


class Attention(nn.Module):
    def __init__(self, n_head: int = 4, width: int = 24) -> None:
        super().__init__()
        self.n_head = n_head
        self.q, self.o = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return self.o(self.q(x).unflatten(-1, (self.n_head, -1)).flatten(-2))


def test_a_style_added_as_one_record_is_listed_checked_and_applied_with_its_head_splitting(monkeypatch):
    monkeypatch.setitem(STYLES, "colwise_copy", TPStyle("colwise_copy", "colwise, under a name of its own",
                                                        lambda t: ColwiseParallel(), sharded_weight_dim=0,
                                                        splits_heads=True))
    plan = {"q": "colwise_copy", "o": "rowwise"}
    with pytest.raises(ValueError, match=r"valid styles are embedding, .*, colwise_copy$"):
        check_tp_plan(Attention(), {"q": "diagonal"}, 2, sequence_parallel=False)
    with pytest.raises(ValueError, match=r"TP style 'colwise_copy' splits dim 0 of q.weight \(24, 24\), which is "
                                         r"not divisible by parallelism.tp=5"):
        check_tp_plan(Attention(), plan, 5, sequence_parallel=False)
    module = Attention()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        apply_tp(module, init_device_mesh("cpu", (2,)), plan, sequence_parallel=False, loss_parallel=False)
    finally:
        dist.destroy_process_group()
    assert module.q.weight.to_local().shape == (12, 24) and module.n_head == 2  # its owner's heads are per-rank


def class_without_source(code: str, **names) -> type:
    """The class ``code`` defines, compiled from a string: ``inspect.getsource`` cannot read it."""
    namespace = {"nn": nn, "F": F, **names}
    exec(compile(textwrap.dedent(code), "<generated>", "exec"), namespace)
    return namespace["MLP"]


def gpt_with_mlp(mlp: type) -> GPTModule:
    module = GPTModule()
    for block in module.model.h:
        block.mlp = mlp(module.config)
    return module


MLP = """
    class MLP(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.fc, self.config = nn.Linear(config.n_embd, config.n_embd), config

        {decorator}
        def forward(self, x):
            return F.silu(self.fc(x)){reads}
"""


def logged(forward):
    """A decorator that keeps no ``__wrapped__``: the function it wraps is in its closure."""
    def call(self, x):
        return forward(self, x)
    return call


def test_a_class_without_source_that_holds_the_shared_config_but_reads_no_head_count_lets_it_be_divided():
    mlp = class_without_source(MLP.format(decorator="", reads=""))
    check_tp_plan(gpt_with_mlp(mlp), ATTENTION_ONLY, 2, sequence_parallel=False)


def test_a_head_count_read_inside_a_decorated_method_without_source_counts_as_read():
    mlp = class_without_source(MLP.format(decorator="@logged", reads=" * (self.config.n_head > 0)"), logged=logged)
    message = r"read by model.h.0.mlp \(MLP\), model.h.1.mlp \(MLP\), which the plan does not shard"
    with pytest.raises(ConfigError, match=message):
        check_tp_plan(gpt_with_mlp(mlp), ATTENTION_ONLY, 2, sequence_parallel=False)
