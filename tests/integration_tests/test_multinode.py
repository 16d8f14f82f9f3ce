"""Multi-node: `--trainer.num_nodes N` under torchrun (`--nnodes`) and under SLURM's environment.

Tested on one machine: two torchrun launchers with `--nnodes 2 --node-rank {0,1}` are two
"nodes" of two CPU ranks each (gloo), each node in a working directory of its own. HSDP puts
`dp_replicate=2` across the nodes and `dp_shard=2` within each (the mesh's outer dim spans
nodes: ranks 0,1 on node 0 shard, ranks 0 and 2 replicate). The run must match one process.
"""

import csv
import math
import os

import pytest
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from titan_lightning.checkpoint import verify
from titan_lightning.cli import prepare
from titan_lightning.testing.launch import launch_nodes, run_single

STEPS = 3
NODES, PER_NODE = 2, 2
# The debug model's layers on a smaller shape (the layout across nodes, not the size, is under test).
FIT = ["fit", "--trainer.accelerator", "cpu", "--trainer.max_steps", str(STEPS), "--trainer.limit_val_batches", "0",
       "--trainer.enable_progress_bar", "false", "--job.model.dim", "64", "--job.model.n_layers", "2",
       "--job.model.n_heads", "4", "--job.model.n_kv_heads", "4", "--job.training.seq_len", "64"]
# The README's layout: recipes.llama3:hsdp2x2 is recipes.llama3:debugmodel with the same global batch
# (4 sequences: one on each of the 2 x 2 data-parallel ranks).
SINGLE = [*FIT, "--recipe", "recipes.llama3:debugmodel", "--job.training.tokens_per_microbatch_per_dp_rank", "256"]
HSDP = [*FIT, "--recipe", "recipes.llama3:hsdp2x2", "--job.training.tokens_per_microbatch_per_dp_rank", "64",
        "--trainer.devices", str(PER_NODE), "--trainer.num_nodes", str(NODES)]


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.multi_process
@pytest.mark.slow
def test_hsdp_across_two_torchrun_nodes_matches_one_process_and_writes_its_run_once(tmp_path):
    single = run_single([*SINGLE, "--trainer.enable_checkpointing", "false"], out_dir=tmp_path / "single",
                        timeout=300).ranks[0]
    nodes = launch_nodes(HSDP, NODES, PER_NODE, out_dir=tmp_path / "nodes", timeout=300)

    for rank, record in enumerate(nodes.ranks):
        node = rank // PER_NODE
        assert (tmp_path / "nodes" / f"node{node}" / f"rank{rank}.json").exists()  # written by node `node`
        assert (record["rank"], record["world_size"]) == (rank, NODES * PER_NODE)
        assert record["cluster_environment"] == "TorchElasticEnvironment"
        assert record["steps"] == list(range(1, STEPS + 1))
        for name in ("losses", "grad_norms"):
            assert all(math.isfinite(x) for x in record[name])
            for step, (value, reference) in enumerate(zip(record[name], single[name]), start=1):
                assert _relative(value, reference) < 1e-5, (rank, name, step, value, reference)

    # Node 0's rank 0 writes the run: one set of logs; the checkpoint folder it chose holds every
    # rank's shards (all 4 ranks save there: on real nodes it must be on a shared filesystem).
    run = tmp_path / "nodes" / "node0" / "run"
    assert not (tmp_path / "nodes" / "node1" / "run").exists()
    with open(run / "csv" / "metrics.csv") as f:
        logged = [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]
    assert logged == nodes.ranks[0]["losses"]  # each step once
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1
    (checkpoint,) = (run / "checkpoints").iterdir()
    assert checkpoint.name == f"epoch=0-step={STEPS}.ckpt"
    assert verify(checkpoint)["world_size"] == NODES * PER_NODE


# Rank 3 = local rank 1 of node 1, in 2 nodes x 2 ranks, as each launcher sets it.
TORCHRUN_RANK3 = {
    "TORCHELASTIC_RUN_ID": "multinode", "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1", "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
}
SLURM_RANK3 = {  # srun in `sbatch --nodes 2 --ntasks-per-node 2`
    "SLURM_JOB_NAME": "multinode", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "1", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
    "SLURM_NODELIST": "gpu[07-08]",
}


@pytest.mark.parametrize("launcher, environment", [(TORCHRUN_RANK3, "TorchElasticEnvironment"),
                                                   (SLURM_RANK3, "SLURMEnvironment")], ids=["torchrun", "slurm"])
def test_each_rank_knows_its_node_and_the_world_from_its_launcher(launcher, environment, monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "TORCHELASTIC_", "PMI_", "OMPI_", "LSB_")):
            monkeypatch.delenv(name)
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    # The Trainer sets Lightning's process-wide rank_zero_only.rank to 3: given back after the test.
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)
    _, _, trainer = prepare(HSDP)  # builds the Trainer; nothing is launched
    assert type(trainer.strategy).__name__ == "TitanStrategy"
    assert type(trainer.strategy.cluster_environment).__name__ == environment
    assert (trainer.num_nodes, trainer.num_devices, trainer.world_size) == (NODES, PER_NODE, NODES * PER_NODE)
    assert (trainer.node_rank, trainer.local_rank, trainer.global_rank) == (1, 1, 3)
    # What the launcher checks before it runs anything (SLURM: --ntasks-per-node and --nodes agree).
    trainer.strategy.cluster_environment.validate_settings(num_devices=PER_NODE, num_nodes=NODES)
