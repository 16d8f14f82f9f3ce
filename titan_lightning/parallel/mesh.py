"""ParallelDims: parallel degrees + world size -> a named DeviceMesh.

Mesh dims, outermost to innermost: pp, dp_replicate, dp_shard, cp, tp. Only dims with a
degree above 1 exist (disabled dims cost no process groups). Flattened views:

    dp           dp_replicate x dp_shard   data loading (ranks that see different batches)
    dp_shard_cp  dp_shard x cp             FSDP sharding
    dp_cp        dp_replicate x dp_shard x cp   loss and metric reduction
    stage        every dim but pp               (pp > 1 only) ranks holding the same layers

Lightning's ModelParallelStrategy names: ``data_parallel`` (dp_replicate x dp_shard) and
``tensor_parallel`` (tp) are flattened views too, so code written for it (``fully_shard(mesh=
self.device_mesh["data_parallel"])``) runs unchanged. For them dp_shard and tp are dims of
the root mesh even at degree 1 (a size-1 dim costs a size-1 group, nothing else).

Experts (ep > 1) live on a second mesh over the same ranks, the sparse mesh
(pp, dp_replicate, efsdp, ep): the ep ranks are taken from dp_shard x cp x tp (innermost,
contiguous ranks), and routed experts are FSDP-sharded over the rest, efsdp = dp_shard *
cp * tp / ep. ``get("ep")`` and ``get("efsdp")`` read it.
"""

from dataclasses import dataclass
from typing import Optional

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_lightning._compat import clear_dtensor_caches, flatten_mesh
from titan_lightning.config import ParallelismConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    # Under pipeline parallelism: the ranks of one stage (they hold the same layers).
    "stage": ("dp_replicate", "dp_shard", "cp", "tp"),
}

# ModelParallelStrategy's dim names, over the dims present in the root mesh.
LIGHTNING_NAMES = {"data_parallel": ("dp_replicate", "dp_shard"), "tensor_parallel": ("tp",)}


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees of one run (dp_shard=-1 already replaced); ``from_config`` takes a
    config that config/validation.py validated."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int

    @classmethod
    def from_config(cls, config: ParallelismConfig, world_size: int) -> "ParallelDims":
        return cls(dp_replicate=config.dp_replicate, dp_shard=config.resolved_dp_shard(world_size), cp=config.cp,
                   tp=config.tp, pp=config.pp, ep=config.ep, world_size=world_size)

    def degree(self, dim: str) -> int:
        return getattr(self, dim)

    @property
    def enabled_dims(self) -> tuple[str, ...]:
        return tuple(dim for dim in MESH_DIMS if self.degree(dim) > 1)

    @property
    def efsdp(self) -> int:
        """Ranks the routed experts are FSDP-sharded over (dp_shard * cp * tp / ep)."""
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def describe(self) -> str:
        """The `# parallelism:` line of golden files: FSDP=2, TP=2 ... (or 'single device')."""
        names = {"dp_replicate": "DP", "dp_shard": "FSDP", "cp": "CP", "tp": "TP", "pp": "PP"}
        parts = [f"{names[d]}={self.degree(d)}" for d in ("dp_replicate", "dp_shard", "tp", "cp", "pp") if self.degree(d) > 1]
        if self.ep > 1:
            parts.append(f"EP={self.ep}")
        return ", ".join(parts) or "single device"

    def build_mesh(self, device_type: str, lightning_names: bool = False) -> "Mesh":
        """``lightning_names``: the root mesh's dims are called as ModelParallelStrategy calls them,
        ``("data_parallel", "tensor_parallel")`` (for its ``data_parallel_size``/``tensor_parallel_size``:
        only dp_shard and tp may be enabled); otherwise ours, with those names as flattened views."""
        dims = self.enabled_dims
        root_dims = tuple(d for d in MESH_DIMS if d in dims or d in ("dp_shard", "tp"))
        if lightning_names:
            if set(dims) - {"dp_shard", "tp"}:
                raise ValueError(f"ModelParallelStrategy's mesh names need a dp_shard x tp layout; got {self.describe()}")
            renamed = {"dp_shard": "data_parallel", "tp": "tensor_parallel"}
            mesh = init_device_mesh(device_type, (self.dp_shard, self.tp), mesh_dim_names=tuple(renamed.values()))
            return Mesh(self, mesh, {dim: mesh[renamed[dim]] for dim in dims})
        mesh = init_device_mesh(device_type, tuple(self.degree(d) for d in root_dims), mesh_dim_names=root_dims)
        views = {dim: mesh[dim] for dim in dims}
        for name, parts in LIGHTNING_NAMES.items():
            views[name] = flatten_mesh(mesh[tuple(d for d in parts if d in root_dims)], name)
        for name, parts in FLATTENED.items():
            present = tuple(d for d in parts if d in dims)
            if name == "stage" and not self.pp_enabled:
                continue
            if len(present) > 1:
                # Kept here: slicing a flattened dim back out of the root mesh is deprecated.
                views[name] = flatten_mesh(mesh[present], name)
        if self.ep_enabled:
            # efsdp stays even at degree 1: expert FSDP and the ep-sharded weights then form
            # the 2-D (efsdp, ep) layout FSDP expects of DTensor parameters.
            sparse_dims = tuple(d for d in ("pp", "dp_replicate") if self.degree(d) > 1) + ("efsdp", "ep")
            sparse = init_device_mesh(device_type, tuple(self.degree(d) for d in sparse_dims),
                                      mesh_dim_names=sparse_dims)
            views.update({f"sparse:{dim}": sparse[dim] for dim in sparse_dims})
            views["sparse"] = sparse
        return Mesh(self, mesh, views)


class Mesh:
    """The DeviceMesh of a run plus name lookup that knows about disabled dims.

    ``get(name)`` returns the sub-mesh of a mesh dim or flattened view, or None when
    every dim it spans has degree 1 (nothing to communicate over).
    """

    def __init__(self, dims: ParallelDims, device_mesh: DeviceMesh, views: dict[str, DeviceMesh]) -> None:
        self.dims = dims
        self.device_mesh = device_mesh
        self._views = views

    def get(self, name: str) -> Optional[DeviceMesh]:
        if name in ("ep", "efsdp"):
            return self._views.get(f"sparse:{name}") if self.dims.ep_enabled else None
        if name == "stage" and not self.dims.pp_enabled:
            return None
        parts = FLATTENED.get(name, (name,))
        present = tuple(d for d in parts if self.dims.degree(d) > 1)
        if not present:
            return None
        # One enabled dim is that dim's mesh; several were flattened under `name` by build_mesh.
        return self._views[present[0] if len(present) == 1 else name]

    def fsdp_mesh(self) -> Optional[DeviceMesh]:
        """The mesh FSDP shards over: dp_shard x cp, or for HSDP (dp_replicate, dp_shard x cp)."""
        if not self.dims.dp_replicate_enabled:
            return self.get("dp_shard_cp")
        shard = [d for d in ("dp_shard", "cp") if self.dims.degree(d) > 1]
        return self.device_mesh["dp_replicate", "dp_shard_cp" if len(shard) == 2 else shard[0]]

    def expert_fsdp_mesh(self) -> Optional[DeviceMesh]:
        """The mesh routed experts are FSDP-sharded over: (dp_replicate, efsdp) or (efsdp,)."""
        sparse = self._views.get("sparse")
        if sparse is None:
            return None
        return sparse["dp_replicate", "efsdp"] if self.dims.dp_replicate_enabled else sparse["efsdp"]

    def rank_and_size(self, name: str) -> tuple[int, int]:
        """(local rank, size) of this process in a dim or view; (0, 1) when disabled."""
        sub = self.get(name)
        return (0, 1) if sub is None else (sub.get_local_rank(), sub.size())


def release_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions, which hold on to the meshes they saw.

    A mesh equal to an old one (same shape and names) would otherwise get results that
    point at the old, destroyed process groups: a process that runs several process-group
    lifetimes (tests, notebooks, fit then validate) calls this when a group is destroyed.
    These caches are torch internals, so each is cleared only where it exists.
    """
    clear_dtensor_caches()
