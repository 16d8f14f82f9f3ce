"""Warmup-stable-decay schedule and the optimizer choice."""

import math

import pytest
import torch

from titan_lightning.config import LRScheduleConfig, OptimizerConfig
from titan_lightning.optim import build_lr_scheduler, build_optimizer, wsd_lambda


def test_warmup_rises_linearly_and_never_starts_at_zero():
    f = wsd_lambda(LRScheduleConfig(warmup_steps=3, decay_ratio=0.0), max_steps=10)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_stable_phase_then_linear_decay_to_min():
    f = wsd_lambda(LRScheduleConfig(warmup_steps=2, decay_ratio=0.4, min_lr_factor=0.1), max_steps=10)
    assert [f(s) for s in range(2, 6)] == [1.0, 1.0, 1.0, 1.0]
    # Decay covers steps 6..9; progress 0, 1/4, 2/4, 3/4.
    expected = [0.1 + 0.9 * (1 - p) for p in (0.0, 0.25, 0.5, 0.75)]
    assert [f(s) for s in range(6, 10)] == pytest.approx(expected)


@pytest.mark.parametrize(
    "decay_type, curve",
    [
        ("linear", lambda p: 1 - p),
        ("sqrt", lambda p: 1 - math.sqrt(p)),
        ("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
    ],
)
def test_decay_curves(decay_type, curve):
    f = wsd_lambda(LRScheduleConfig(warmup_steps=0, decay_type=decay_type), max_steps=8)
    assert [f(s) for s in range(8)] == pytest.approx([curve(s / 8) for s in range(8)])


def test_scheduler_drives_optimizer_lr():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = build_optimizer([param], OptimizerConfig(lr=1.0), torch.device("cpu"))
    scheduler = build_lr_scheduler(optimizer, LRScheduleConfig(warmup_steps=1, decay_ratio=0.5), max_steps=4)
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.5, 1.0, 1.0, 0.5])


@pytest.mark.parametrize("implementation", [None, "fused", "foreach", "for-loop"])
def test_adamw_implementation(implementation):
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = build_optimizer([param], OptimizerConfig(implementation=implementation), torch.device("cpu"))
    group = optimizer.param_groups[0]
    assert isinstance(optimizer, torch.optim.AdamW)
    assert bool(group["fused"]) == (implementation in (None, "fused"))
    assert bool(group["foreach"]) == (implementation == "foreach")
    param.grad = torch.ones(3)
    optimizer.step()
    assert torch.all(param < 1)


def test_warmup_longer_than_the_run_is_shortened_with_a_warning():
    with pytest.warns(UserWarning, match=r"warmup_steps=10 plus 2 decay steps exceed trainer.max_steps=4; warming up for 2"):
        f = wsd_lambda(LRScheduleConfig(warmup_steps=10, decay_ratio=0.5), max_steps=4)
    assert [f(s) for s in range(4)] == pytest.approx([1 / 3, 2 / 3, 1.0, 0.5])
    with pytest.warns(UserWarning, match=r"warming up for 3 steps"):
        f = wsd_lambda(LRScheduleConfig(warmup_steps=10), max_steps=3)
    assert [f(s) for s in range(3)] == pytest.approx([0.25, 0.5, 0.75])


def test_norms_and_biases_can_skip_weight_decay():
    from titan_lightning.config import OptimizerConfig
    from titan_lightning.optim import build_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=False))
    plain = build_optimizer(model.parameters(), OptimizerConfig(weight_decay=0.1), torch.device("cpu"))
    assert [(len(g["params"]), g["weight_decay"]) for g in plain.param_groups] == [(5, 0.1)]
    split = build_optimizer(model.parameters(), OptimizerConfig(weight_decay=0.1, decay_norms_and_biases=False),
                            torch.device("cpu"))
    decayed, kept = split.param_groups
    assert {id(p) for p in decayed["params"]} == {id(model[0].weight), id(model[2].weight)}
    assert decayed["weight_decay"] == 0.1 and kept["weight_decay"] == 0.0 and len(kept["params"]) == 3
