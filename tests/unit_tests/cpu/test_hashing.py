"""hash_model / hash_gradient: bitwise fingerprints that agree on reruns and name what diverged."""

import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from titan_lightning.parallel.fake import init_fake_process_group
from titan_lightning.testing.hashing import first_difference, hash_gradient, hash_model


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 2)
        self.unused = torch.nn.Parameter(torch.ones(3))  # never in the graph: no grad
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)) * self.scale)


def tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def backward(model: torch.nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()


X = torch.linspace(-1, 1, 12).reshape(3, 4)


def test_same_seed_gives_same_hash_and_another_seed_does_not():
    assert hash_model(tiny(0)) == hash_model(tiny(0))
    assert hash_model(tiny(0)) != hash_model(tiny(1))
    assert len(hash_model(tiny(0))) == 64


def test_one_changed_element_changes_the_hash_and_per_tensor_names_it():
    a, b = tiny(), tiny()
    with torch.no_grad():
        b.out.weight[1, 3] += 1e-3
    assert hash_model(a) != hash_model(b)
    assert first_difference(hash_model(a, per_tensor=True), hash_model(b, per_tensor=True)) == "out.weight"


def test_per_tensor_is_sorted_json_of_every_parameter_and_buffer():
    hashes = json.loads(hash_model(tiny(), per_tensor=True))
    assert list(hashes) == sorted(["inp.weight", "inp.bias", "out.weight", "out.bias", "unused", "scale"])
    assert all(len(h) == 64 for h in hashes.values())


def test_first_difference_is_none_when_equal_and_reports_a_missing_name():
    a = hash_model(tiny(), per_tensor=True)
    assert first_difference(a, a) is None
    fewer = json.dumps({k: v for k, v in json.loads(a).items() if k != "scale"})
    assert first_difference(a, fewer) == "scale"
    assert first_difference(fewer, a) == "scale"


def test_a_buffer_change_changes_the_model_hash():
    a, b = tiny(), tiny()
    b.scale[0] = 0.25
    assert hash_model(a) != hash_model(b)
    assert first_difference(hash_model(a, per_tensor=True), hash_model(b, per_tensor=True)) == "scale"


def test_bf16_model_hashes_and_differs_from_fp32():
    model = tiny().to(torch.bfloat16)
    assert hash_model(model) == hash_model(tiny().to(torch.bfloat16))
    assert hash_model(model) != hash_model(tiny())


def test_dtype_and_shape_are_part_of_the_hash_not_only_the_bytes():
    same_bytes = [torch.zeros(4, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32),
                  torch.zeros(16, dtype=torch.uint8)]
    hashes = set()
    for t in same_bytes:
        holder = torch.nn.Module()
        holder.register_buffer("t", t)
        hashes.add(hash_model(holder))
    assert len(hashes) == 3


def test_gradient_hash_is_stable_across_identical_backwards_and_follows_the_input():
    model = tiny()
    backward(model, X)
    first = hash_gradient(model)
    backward(model, X)
    assert hash_gradient(model) == first
    backward(model, X * 2)
    assert hash_gradient(model) != first


def test_parameters_without_grad_are_recorded_as_such():
    model = tiny()
    before = json.loads(hash_gradient(model, per_tensor=True))  # nothing has a grad yet
    backward(model, X)
    after = json.loads(hash_gradient(model, per_tensor=True))
    assert model.unused.grad is None
    assert after["unused"] == before["unused"]
    assert all(after[name] != before[name] for name in after if name != "unused")
    model.unused.grad = torch.zeros(3)  # a zero grad is not "no grad"
    assert first_difference(json.dumps(after), hash_gradient(model, per_tensor=True)) == "unused"


def test_a_meta_model_is_refused_by_name():
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'weight'.*meta"):
        hash_model(model)


@pytest.fixture
def fake_pg(request):
    init_fake_process_group(rank=request.param, world_size=2)
    request.addfinalizer(dist.destroy_process_group)
    return request.param


@pytest.mark.parametrize("fake_pg", [1], indirect=True)
def test_ranks_other_than_zero_return_empty_strings(fake_pg):
    model = tiny()
    backward(model, X)
    assert hash_model(model) == hash_model(model, per_tensor=True) == ""
    assert hash_gradient(model) == hash_gradient(model, per_tensor=True) == ""


def with_weight(weight: torch.Tensor) -> torch.nn.Module:
    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(weight)
    return holder


def distributed(t: torch.Tensor, placement) -> torch.nn.Module:
    mesh = init_device_mesh("cpu", (2,))
    return with_weight(distribute_tensor(t, mesh, [placement], src_data_rank=None))


@pytest.mark.parametrize("fake_pg", [0], indirect=True)
def test_rank_zero_hashes_dtensor_local_shards_and_their_layout(fake_pg):
    t = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    sharded = distributed(t, Shard(0))
    assert sharded.weight.to_local().shape == (2, 4)
    assert hash_model(sharded) == hash_model(distributed(t.clone(), Shard(0)))
    assert hash_model(sharded) != hash_model(distributed(t, Replicate()))
    assert hash_model(sharded) != hash_model(distributed(t + 1, Shard(0)))
    # Same local bytes and shape as the rank-0 shard: the layout alone tells them apart.
    assert hash_model(sharded) != hash_model(distributed(t[:2].clone(), Replicate()))
    assert hash_model(sharded) != hash_model(with_weight(t[:2].clone()))


@pytest.mark.parametrize("fake_pg", [0], indirect=True)
def test_rank_zero_hashes_dtensor_gradients(fake_pg):
    model = distributed(torch.arange(16, dtype=torch.float32).reshape(4, 4), Shard(0))
    assert json.loads(hash_gradient(model, per_tensor=True)).keys() == {"weight"}
    model.weight.grad = model.weight.detach() * 2
    first = hash_gradient(model)
    assert first == hash_gradient(model)
    model.weight.grad = model.weight.detach() * 3
    assert hash_gradient(model) != first
