"""Run torchtitan's own released trainer (torchtitan 0.2.2) as a throughput-benchmark contender.

Usage (``python -m benchmarks.throughput --contenders torchtitan`` builds the workload from the
recipe the titan row runs: ``torchtitan_workload`` there):

    python3 benchmarks/contenders/torchtitan_run.py --workload '<json>' --steps N --warmup W --out result.json

The workload JSON holds exactly the keys of ``WORKLOAD_KEYS`` (an unknown or missing key is an
error; ``default_workload()`` gives every one: Llama 3 8B's shape, seq 8192, batch 1):

    model         model ("llama3" | "qwen3" | "deepseek_v3": torchtitan's model names) and
                  model_args (the fields of that model's torchtitan ModelArgs dataclass:
                  TransformerModelArgs, Qwen3ModelArgs, DeepSeekV3ModelArgs; the nested
                  rope_scaling_args and moe_args as dicts of RoPEScalingArgs' and MoEArgs' fields)
    step          seq_len, batch, training_dtype, mixed_precision_param ("float32" | "bfloat16")
    optimizer     lr, beta1, beta2, eps, weight_decay, max_norm, warmup_steps, decay_ratio,
                  decay_type, min_lr_factor, seed
    parallelize   compile (bool), compile_components (list, of "model" and "loss"),
                  ac ("selective" | "none" | "full"), ac_option ("op" or an int as a string),
                  float8 (null or {recipe: "tensorwise" | "rowwise", filter_fqns: [...], emulate})
    data          dataset_path (a text file, documents separated by <|endoftext|>),
                  tokenizer_path (a folder holding tokenizer.json)

Install of torchtitan on the (offline) GPU machine, from the wheels carried in .whl/torchtitan/
(torchtitan 0.2.2, torchdata 0.11.0, tyro 1.0.17, typeguard, docstring_parser, typing_extensions,
tomli; torchao for the float8 workloads):

    python3 -m pip install -q --no-index --no-deps --target /tmp/ttsite .whl/torchtitan/*.whl
    PYTHONPATH=/tmp/ttsite:$PYTHONPATH python3 benchmarks/contenders/torchtitan_run.py ...

(``benchmarks.throughput`` puts ``$TORCHTITAN_SITE``, default /tmp/ttsite, first on this
process's PYTHONPATH.)

What this script does to torchtitan (none of torchtitan's files are edited):

* Stubbed module ``datasets`` (Hugging Face datasets, not carried: it is large and pulls
  dill/multiprocess/aiohttp/huggingface_hub...). torchtitan imports it at import time only in
  ``torchtitan.hf_datasets.text_datasets`` (``Dataset``, ``load_dataset``,
  ``datasets.distributed.split_dataset_by_node``) and ``models/flux`` (unused). The stub gives a
  minimal map-style ``Dataset`` base class (``__len__``/``__getitem__``/``skip``), a
  ``load_dataset`` that raises (no network / no hub), and ``split_dataset_by_node`` (strided
  sharding; identity at world size 1).
* Registered, at runtime, dataset ``tl_corpus`` in torchtitan's ``DATASETS`` registry: the
  documents of the workload's ``dataset_path`` (the harness passes the corpus the titan row
  reads: titan_lightning/assets/corpus/python_reference.txt, ``CORPUS_PATH`` of
  titan_lightning.data.tokenizer), split on ``<|endoftext|>``, fed through torchtitan's own
  ``HuggingFaceTextDataset`` / ``ParallelAwareDataloader`` (StatefulDataLoader) and torchtitan's
  own ``HuggingFaceTokenizer`` loaded from ``tokenizer_path``/tokenizer.json (the harness passes
  the titan row's: titan_lightning/assets/tokenizer, ``TOKENIZER_PATH``'s folder; a 2048-token
  BPE, token ids < 2048 < vocab_size, the model keeps the workload's vocab_size, e.g. 128256).
* Registered, at runtime, model flavor ``tl_bench`` in the model's flavor table
  (``llama3_args``, ``qwen3_args``, ``deepseekv3_args``) built from the workload's model_args
  (torchtitan has no Llama 1B/3B flavor, and the benchmark shapes have fewer layers).
* ``Trainer.train_step`` is wrapped (on the instance) to time each call, with
  ``torch.cuda.synchronize()`` before and after; ``metrics_processor.log`` is wrapped to record
  the step's loss and ``torch.cuda.max_memory_allocated()`` just before torchtitan resets the peak
  memory stats (it does so at every log). The step itself is torchtitan's, untouched; it includes
  torchtitan's per-step data fetch (tokenizing the next window) and, with log_freq=1, its
  ``loss.item()`` / ``grad_norm.item()`` for logging.
* CPU only (no CUDA visible, for a smoke test): torchtitan picks ``device_type = "cuda"`` when no
  accelerator is present, so while importing ``torchtitan.tools.utils`` the device type is made
  ``"cpu"`` and its device module a shim of ``torch.cpu`` with the memory/property calls
  torchtitan makes (no-ops / zeros). Not applied when CUDA is available.

Settings (torchtitan defaults at world size 1 unless stated): process group of world size 1
(nccl on CUDA, gloo on CPU), no FSDP (data_parallel_shard_degree resolves to 1), so bf16 mixed
precision is torch.autocast(bfloat16) over fp32 parameters (training.dtype float32,
mixed_precision_param bfloat16), as the titan row on one device; fused AdamW, the optimizer,
the warmup-stable-decay schedule, clipping and seed of the titan row's recipe; AC "selective"
with option "op" = torchtitan's per-op SAC; compile = torchtitan's per-TransformerBlock compile of
the model plus the compiled loss; float8 = torchtitan's converter ``quantize.linear.float8``
(torchao's ``Float8LinearConfig.from_recipe_name``, the same linears as ours: nn.Linear with
dimensions divisible by 16, ``filter_fqns`` left out, so the head stays bf16; rowwise sets
inductor's ``emulate_precision_casts`` as ours does); checkpointing, validation, tensorboard,
profiling off; metrics.log_freq 1.

Differences from the titan row that remain (torchtitan's code, not options):

* Init: torchtitan's own ``init_weights`` (the same std formulas, depth_init, but its own RNG
  draws), so losses differ from step 1 on.
* Data: torchtitan's text dataset tokenizes document by document and packs them into windows
  itself (its tokenizer adds BOS/EOS as it infers from the folder); ours packs the corpus's
  token stream with the data module. The same text, not the same windows.
* Compile: torchtitan compiles each dense TransformerBlock whole (and the loss), as ours does.
  In an MoE block (Qwen 3, DeepSeek V3) torchtitan compiles each child but the MoE's routed
  experts, which stay eager (its workaround for FSDP hooks and pytorch/torchtitan#1940); ours,
  with ``compile.components`` "moe" (the default), compiles the whole block, experts included.
  The embedding, final norm and head run eager in both.
* MoE load balancing: torchtitan 0.2.2's Qwen 3 train spec builds plain optimizers, so the
  expert bias is never updated there (its DeepSeek V3 spec updates it, as ours does for both).
  Routing (scores, normalization, groups) and grouped GEMM experts are the same.
* MoE on CPU: torchtitan's routing calls ``torch.histc`` on integer ids, which has no CPU
  kernel; the MoE workloads run on CUDA only.
* SAC: torchtitan's per-op policy (save every other matmul, keep SDPA's and reductions'
  outputs); ours is a port of it, not verified op for op.
* The step's host work: torchtitan logs (``.item()`` of loss and grad norm) every step here
  (log_freq 1), as our metrics callback reads the loss every step.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EOT = "<|endoftext|>"
FLAVOR = "tl_bench"
DATASET = "tl_corpus"

# Every key a workload holds (see the module docstring); the harness passes all of them.
WORKLOAD_KEYS = (
    "model", "model_args",
    "seq_len", "batch", "training_dtype", "mixed_precision_param",
    "lr", "beta1", "beta2", "eps", "weight_decay", "max_norm", "warmup_steps", "decay_ratio", "decay_type",
    "min_lr_factor", "seed",
    "compile", "compile_components", "ac", "ac_option", "float8",
    "dataset_path", "tokenizer_path",
)
FLOAT8_RECIPES = ("tensorwise", "rowwise")
# torchtitan's model name: (its module, the flavor table in it, the ModelArgs class in it).
MODELS = {
    "llama3": ("torchtitan.models.llama3", "llama3_args", "TransformerModelArgs"),
    "qwen3": ("torchtitan.models.qwen3", "qwen3_args", "Qwen3ModelArgs"),
    "deepseek_v3": ("torchtitan.models.deepseek_v3", "deepseekv3_args", "DeepSeekV3ModelArgs"),
}
COMPILE_COMPONENTS = ("model", "loss")


def default_workload() -> dict:
    """Llama 3 8B's shape at seq 8192, batch 1, the recipe defaults, the shipped corpus and
    tokenizer (their paths from titan_lightning.data.tokenizer, where the data module reads them)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from titan_lightning.data.tokenizer import CORPUS_PATH, TOKENIZER_PATH

    return {
        "model": "llama3",
        "model_args": {
            "dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256,
            "ffn_dim_multiplier": 1.3, "multiple_of": 1024, "rope_theta": 500000.0,
            "rope_scaling_args": {"scaling_factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192},
            "norm_eps": 1e-5, "max_seq_len": 8192, "depth_init": True, "attn_type": "sdpa",
            "attn_mask_type": "causal",
        },
        "seq_len": 8192, "batch": 1, "training_dtype": "float32", "mixed_precision_param": "bfloat16",
        "lr": 3e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "max_norm": 1.0,
        "warmup_steps": 200, "decay_ratio": 0.2, "decay_type": "linear", "min_lr_factor": 0.0, "seed": 0,
        "compile": False, "compile_components": ["model", "loss"], "ac": "selective", "ac_option": "op",
        "float8": None,
        "dataset_path": str(CORPUS_PATH), "tokenizer_path": str(TOKENIZER_PATH.parent),
    }


def check_workload(w: dict) -> None:
    """Every key of ``WORKLOAD_KEYS``, no other, valid values, and the data files present."""
    missing = [k for k in WORKLOAD_KEYS if k not in w]
    unknown = [k for k in w if k not in WORKLOAD_KEYS]
    if missing or unknown:
        raise ValueError(f"workload: missing keys {missing}, unknown keys {unknown}; valid: {', '.join(WORKLOAD_KEYS)}")
    if w["model"] not in MODELS:
        raise ValueError(f"workload model must be one of {', '.join(MODELS)}, got {w['model']!r}")
    if w["ac"] not in ("selective", "none", "full"):
        raise ValueError(f"workload ac must be selective|none|full, got {w['ac']!r}")
    for key in ("training_dtype", "mixed_precision_param"):
        if w[key] not in ("float32", "bfloat16"):
            raise ValueError(f"workload {key} must be float32|bfloat16, got {w[key]!r}")
    bad = [c for c in w["compile_components"] if c not in COMPILE_COMPONENTS]
    if bad:
        raise ValueError(f"workload compile_components {bad}: torchtitan compiles only {', '.join(COMPILE_COMPONENTS)}")
    f8 = w["float8"]
    if f8 is not None and (set(f8) != {"recipe", "filter_fqns", "emulate"} or f8["recipe"] not in FLOAT8_RECIPES):
        raise ValueError(f"workload float8 must be null or {{recipe: {'|'.join(FLOAT8_RECIPES)}, filter_fqns, emulate}}, "
                         f"got {f8!r}")
    if not Path(w["dataset_path"]).is_file():
        raise FileNotFoundError(f"workload dataset_path={w['dataset_path']!r}: no such file")
    if not (Path(w["tokenizer_path"]) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"workload tokenizer_path={w['tokenizer_path']!r}: no tokenizer.json in it")


# --------------------------------------------------------------------------- stubs / patches
def _install_datasets_stub() -> None:
    """Minimal stand-in for Hugging Face ``datasets`` (see module docstring)."""
    if "datasets" in sys.modules:
        return
    try:  # use the real package if it happens to be installed
        import datasets  # noqa: F401

        return
    except ImportError:
        pass

    class Dataset:
        """Map-style dataset over a list of samples (only what torchtitan's text dataset uses)."""

        def __init__(self, samples=None):
            self._samples = list(samples or [])

        def __len__(self):
            return len(self._samples)

        def __getitem__(self, i):
            return self._samples[i]

        def __iter__(self):
            return iter(self._samples)

        def skip(self, n):
            return Dataset(self._samples[n:])

    def load_dataset(*args, **kwargs):
        raise RuntimeError(
            "datasets.load_dataset is stubbed out (offline benchmark); use the registered "
            f"{DATASET!r} dataset"
        )

    def split_dataset_by_node(ds, rank, world_size):
        if world_size == 1:
            return ds
        return Dataset(ds[i] for i in range(rank, len(ds), world_size))

    mod = types.ModuleType("datasets")
    mod.Dataset = Dataset
    mod.IterableDataset = type("IterableDataset", (), {})
    mod.load_dataset = load_dataset
    mod.__version__ = "0.0.0-stub"
    dist = types.ModuleType("datasets.distributed")
    dist.split_dataset_by_node = split_dataset_by_node
    mod.distributed = dist
    sys.modules["datasets"] = mod
    sys.modules["datasets.distributed"] = dist


def _cpu_device_module():
    """torch.cpu plus the CUDA-style calls torchtitan makes on its device module."""
    import torch

    mod = types.ModuleType("tl_cpu_device_module")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(mod, name, getattr(torch.cpu, name))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    mod.set_device = lambda *a, **k: None
    mod.current_device = lambda: 0
    mod.get_device_name = lambda *a, **k: "cpu"
    mod.get_device_properties = lambda *a, **k: types.SimpleNamespace(total_memory=total)
    mod.memory_stats = lambda *a, **k: {}
    mod.reset_peak_memory_stats = lambda *a, **k: None
    mod.empty_cache = lambda *a, **k: None
    mod.set_stream = lambda *a, **k: None
    return mod


def _import_torchtitan_utils(cpu: bool) -> None:
    """Import torchtitan.tools.utils (which fixes device_type at import); on CPU make it 'cpu'."""
    import torch._utils as tu

    if not cpu:
        import torchtitan.tools.utils  # noqa: F401

        return
    orig_type, orig_mod = tu._get_available_device_type, tu._get_device_module
    shim = _cpu_device_module()
    tu._get_available_device_type = lambda: "cpu"
    tu._get_device_module = lambda dt=None: shim if dt == "cpu" else orig_mod(dt)
    try:
        import torchtitan.tools.utils as ttu

        assert ttu.device_type == "cpu", ttu.device_type
    finally:
        tu._get_available_device_type, tu._get_device_module = orig_type, orig_mod


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- registration
def _load_local_corpus(path: str):
    from datasets import Dataset  # the stub (or the real package)

    text = Path(path).read_text(encoding="utf-8")
    docs = [d.strip() for d in text.split(EOT) if d.strip()]
    samples = [{"text": d} for d in docs]
    if hasattr(Dataset, "from_list"):  # real HF datasets
        return Dataset.from_list(samples)
    return Dataset(samples)


def model_spec(w: dict) -> tuple[str, str, str, dict]:
    """torchtitan's module, flavor table and ModelArgs class names for the workload's model, and
    the ModelArgs fields (nested dataclasses still dicts)."""
    module_name, table, cls_name = MODELS[w["model"]]
    return module_name, table, cls_name, dict(w["model_args"])


def _register(w: dict) -> None:
    import dataclasses
    import importlib

    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS
    from torchtitan.models.llama3.model.args import RoPEScalingArgs
    from torchtitan.models.moe import MoEArgs

    DATASETS[DATASET] = DatasetConfig(
        path=str(w["dataset_path"]),
        loader=_load_local_corpus,
        sample_processor=lambda sample: sample["text"],
    )
    module_name, table, cls_name, kwargs = model_spec(w)
    module = importlib.import_module(module_name)
    cls = getattr(module, cls_name)
    for key, nested in (("rope_scaling_args", RoPEScalingArgs), ("moe_args", MoEArgs)):
        if key in kwargs:
            kwargs[key] = nested(**kwargs[key])
    unknown = set(kwargs) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"workload model_args: {sorted(unknown)} are not fields of torchtitan's {cls_name}")
    getattr(module, table)[FLAVOR] = cls(**kwargs)


def job_args(w: dict, total_steps: int, dump_folder: str) -> list[str]:
    """torchtitan's command line (its ``ConfigManager``'s flags) for the workload."""
    args = [
        "--job.dump_folder", dump_folder,
        "--job.description", "titan_lightning throughput contender",
        "--model.name", str(w["model"]),
        "--model.flavor", FLAVOR,
        "--model.hf_assets_path", str(w["tokenizer_path"]),
        "--optimizer.name", "AdamW",
        "--optimizer.lr", repr(float(w["lr"])),
        "--optimizer.beta1", repr(float(w["beta1"])),
        "--optimizer.beta2", repr(float(w["beta2"])),
        "--optimizer.eps", repr(float(w["eps"])),
        "--optimizer.weight_decay", repr(float(w["weight_decay"])),
        "--optimizer.implementation", "fused",
        "--lr_scheduler.warmup_steps", str(int(w["warmup_steps"])),
        "--lr_scheduler.decay_type", str(w["decay_type"]),
        "--lr_scheduler.min_lr_factor", repr(float(w["min_lr_factor"])),
        "--training.dataset", DATASET,
        "--training.dataset_path", str(w["dataset_path"]),
        "--training.local_batch_size", str(int(w["batch"])),
        "--training.global_batch_size", str(int(w["batch"])),
        "--training.seq_len", str(int(w["seq_len"])),
        "--training.steps", str(total_steps),
        "--training.max_norm", repr(float("inf") if w["max_norm"] is None else float(w["max_norm"])),
        "--training.dtype", str(w["training_dtype"]),
        "--training.mixed_precision_param", str(w["mixed_precision_param"]),
        "--parallelism.data_parallel_shard_degree", "-1",
        "--parallelism.data_parallel_replicate_degree", "1",
        "--activation_checkpoint.mode", str(w["ac"]),
        "--activation_checkpoint.selective_ac_option", str(w["ac_option"]),
        "--metrics.log_freq", "1",
        "--metrics.no-enable-tensorboard",
        "--metrics.no-enable-wandb",
        "--checkpoint.no-enable",
        "--validation.no-enable",
        "--profiling.no-enable-profiling",
        "--profiling.no-enable-memory-snapshot",
        "--debug.seed", str(int(w["seed"])),
        "--compile.enable" if w["compile"] else "--compile.no-enable",
        "--compile.components", ",".join(w["compile_components"]),
    ]
    if w["decay_ratio"] is not None:
        args += ["--lr_scheduler.decay_ratio", repr(float(w["decay_ratio"]))]
    f8 = w["float8"]
    if f8 is not None:
        args += ["--model.converters", "quantize.linear.float8",
                 "--quantize.linear.float8.recipe_name", f8["recipe"],
                 "--quantize.linear.float8.filter_fqns", ",".join(f8["filter_fqns"]),
                 "--quantize.linear.float8.emulate" if f8["emulate"] else "--quantize.linear.float8.no-emulate"]
    return args


# --------------------------------------------------------------------------- main
def run(w: dict, steps: int, warmup: int) -> dict:
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "GROUP_RANK": "0", "ROLE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ[k] = v
    os.environ["MASTER_PORT"] = str(_free_port())

    import torch

    cuda = torch.cuda.is_available()
    _install_datasets_stub()
    _import_torchtitan_utils(cpu=not cuda)

    import torchtitan
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    init_logger()
    _register(w)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from benchmarks.throughput import memory_snapshot_hook

    total_steps = warmup + steps
    dump_folder = tempfile.mkdtemp(prefix="tt_contender_")
    job_config = ConfigManager().parse_args(job_args(w, total_steps, dump_folder))

    step_times: list[float] = []
    losses: list[float] = []
    peaks: list[int] = []

    def sync():
        if cuda:
            torch.cuda.synchronize()

    trainer = None
    try:
        trainer = Trainer(job_config)
        orig_train_step = trainer.train_step

        def timed_train_step(data_iterator):
            sync()
            if cuda:
                memory_snapshot_hook(len(step_times) - warmup, "torchtitan")
            t0 = time.perf_counter()
            out = orig_train_step(data_iterator)
            sync()
            step_times.append(time.perf_counter() - t0)
            return out

        trainer.train_step = timed_train_step

        mp = trainer.metrics_processor
        orig_log = mp.log

        def recording_log(step, global_avg_loss, global_max_loss, *a, **k):
            losses.append(float(global_avg_loss))
            if cuda:  # read before torchtitan resets the peak stats inside log()
                peaks.append(int(torch.cuda.max_memory_allocated()))
            return orig_log(step, global_avg_loss, global_max_loss, *a, **k)

        mp.log = recording_log

        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    if len(step_times) != total_steps:
        raise RuntimeError(f"trainer ran {len(step_times)} steps, expected {total_steps}")
    return {
        "contender": "torchtitan",
        "torchtitan_version": getattr(torchtitan, "__version__", None),
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "workload": w,
        "warmup": warmup,
        "step_times": step_times[warmup:],
        "warmup_step_times": step_times[:warmup],
        # per step (torchtitan resets the peak at every log): the measured steps, as the other rows
        "peak_memory_bytes": max(peaks[warmup:]) if peaks[warmup:] else None,
        "tokens_per_step": int(w["batch"]) * int(w["seq_len"]),
        "losses": losses[warmup:],
        "warmup_losses": losses[:warmup],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", required=True, help="JSON object (see module docstring)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    out = Path(a.out)
    try:
        w = json.loads(a.workload)
        check_workload(w)
        result = run(w, a.steps, a.warmup)
        rc = 0
    except BaseException as e:  # noqa: BLE001 - report every failure, including SystemExit
        traceback.print_exc()
        msg = " ".join(f"{type(e).__name__}: {e}".split())[:2000]
        result = {"contender": "torchtitan", "error": msg}
        rc = 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
