"""Golden numerics: per-step loss and grad norm of a run, exported to a file or compared with one.

A golden file describes itself, then holds one line per optimizer step; floats are
written with ``repr`` so reading one back gives the same float and runs compare exactly::

    # config: llama3_debugmodel
    # ngpu: 1
    # parallelism: single device
    # hardware: cpu
    # torch: 2.13.0
    # cpu: GenuineIntel
    # cpu_model: 6/207
    # step loss grad_norm
    1 7.62591552734375 3.9124813079833984

A file without a ``# step`` line is a legacy ``<step> <loss>`` file: only losses compare.

CPU numbers hold within one CPU vendor's kernel paths (pinned to AVX2 by the test launcher; the
last bits of some steps differ between AMD and Intel): each vendor's files have their own folder
(``hardware_folder``), and a file that names its CPU model compares only on that model.
"""

import functools
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning as L

from titan_lightning.steps import ends_optimizer_step

COLUMNS = ("step", "loss", "grad_norm")
LEGACY_COLUMNS = ("step", "loss")
_REGENERATE = 'regenerate it with GoldenNumerics(..., mode="export") (the runner\'s --export-numerics)'


def hardware_class(device_type: str) -> str:
    """The hardware class numbers belong to: ``cpu``, or the first visible GPU's name without
    its vendor, in lower case (``NVIDIA H200`` -> ``h200``). Exact equality holds within a class."""
    if device_type == "cpu":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"device type {device_type!r} but no GPU is visible")
    name = re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(0).lower()).strip("_")
    return re.sub(r"^(nvidia|amd)_", "", name)


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_vendor() -> str:
    """The CPU vendor (``GenuineIntel``, ``AuthenticAMD``; else the machine type): CPU goldens hold
    within one vendor (same kernel paths, pinned by the test launcher), not necessarily across."""
    vendor = _cpuinfo().get("vendor_id")
    if vendor:
        return vendor
    import platform

    return platform.machine() or "unknown"


def cpu_model() -> Optional[str]:
    """The CPU's family and model numbers (``6/207``), None where the system does not tell them.
    A golden that records them compares only on that model (another generation of one vendor may
    take other kernel paths)."""
    family, model = _cpuinfo().get("cpu family"), _cpuinfo().get("model")
    return f"{family}/{model}" if family and model else None


def hardware_folder(hardware: str) -> str:
    """The folder a hardware class's golden files live in: a GPU class's own name, and on CPU one per
    vendor (``cpu_amd``, ``cpu_intel``, else ``cpu_`` and the vendor or machine type)."""
    if hardware != "cpu":
        return hardware
    vendor = cpu_vendor()
    short = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(vendor) or re.sub(r"[^a-z0-9]+", "_", vendor.lower())
    return f"cpu_{short.strip('_') or 'unknown'}"


def comparable(golden: "Golden", hardware: str) -> Optional[str]:
    """None when ``golden`` can be compared exactly here, else why not (another torch release, CPU
    vendor or, where the file names one, CPU model)."""
    recorded = golden.header.get("torch")
    if recorded is not None and recorded != torch_version():
        return f"recorded with torch {recorded}, this is torch {torch_version()}"
    if hardware != "cpu":
        return None
    vendor, model = golden.header.get("cpu"), golden.header.get("cpu_model")
    if vendor is not None and vendor != cpu_vendor():
        return f"recorded on a {vendor} CPU, this is {cpu_vendor()}"
    if model is not None and model != cpu_model():
        return f"recorded on a {vendor + ' ' if vendor else ''}CPU of model {model}, this is model {cpu_model()}"
    return None


def torch_version() -> str:
    """The running torch's release (``2.13.0``, no local build tag): exact numbers hold within one."""
    import torch

    return torch.__version__.split("+")[0]


@dataclass
class Golden:
    """A golden file read back. ``grad_norms`` is None for a legacy ``<step> <loss>`` file."""

    path: Path
    header: dict[str, str] = field(default_factory=dict)
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad_norms: Optional[list[float]] = None

    @property
    def legacy(self) -> bool:
        return self.grad_norms is None


def read_golden(path: Union[str, Path]) -> Golden:
    """Parse a golden file; a malformed line raises ValueError naming ``file:line``."""
    path = Path(path)
    golden = Golden(path=path)
    columns = LEGACY_COLUMNS
    seen_columns = seen_data = False
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        where = f"{path}:{number}"
        if not line:
            continue
        if line.startswith("#"):
            text = line[1:].strip()
            if text.split()[:1] == ["step"]:
                if seen_data or seen_columns:
                    raise ValueError(f"{where}: the '# step ...' column line must come once, before the data")
                names = tuple(text.split())
                if names not in (COLUMNS, LEGACY_COLUMNS):
                    expected = " or ".join(repr(" ".join(c)) for c in (COLUMNS, LEGACY_COLUMNS))
                    raise ValueError(f"{where}: columns {' '.join(names)!r}; expected {expected}")
                columns, seen_columns = names, True
                if columns == COLUMNS:
                    golden.grad_norms = []
            elif ":" in text and not seen_data:
                key, _, value = text.partition(":")
                if key.strip().isidentifier():
                    golden.header[key.strip()] = value.strip()
            continue
        seen_data = True
        fields = line.split()
        if len(fields) != len(columns):
            raise ValueError(f"{where}: expected {len(columns)} fields ({' '.join(columns)}), got {line!r}")
        try:
            step = int(fields[0])
            values = [float(x) for x in fields[1:]]
        except ValueError:
            raise ValueError(
                f"{where}: expected an integer step and float values ({' '.join(columns)}), got {line!r}"
            ) from None
        for name, value in zip(columns[1:], values):
            if not math.isfinite(value):
                raise ValueError(f"{where}: non-finite {name} {value!r}; a golden file never holds NaN or inf")
        if golden.steps and step <= golden.steps[-1]:
            raise ValueError(f"{where}: step {step} does not follow step {golden.steps[-1]}; steps must increase")
        golden.steps.append(step)
        golden.losses.append(values[0])
        if golden.grad_norms is not None:
            golden.grad_norms.append(values[1])
    return golden


def check_header(golden: Golden, *, ngpu: int, parallelism: str, hardware: Optional[str] = None) -> None:
    """Refuse a golden file recorded on another world size, layout (or hardware class) than this run's.

    Legacy files have no header and pass; a headed file must carry the ngpu and parallelism
    lines; its hardware line, when it has one, must equal ``hardware`` when that is given.
    """
    if golden.legacy:
        return
    expectations = [("ngpu", str(ngpu)), ("parallelism", parallelism)]
    if hardware is not None and "hardware" in golden.header:
        expectations.append(("hardware", hardware))
    for key, expected in expectations:
        found = golden.header.get(key)
        if found is None:
            raise ValueError(f"{golden.path}: has no '# {key}:' line; expected '# {key}: {expected}'; {_REGENERATE}")
        if found != expected:
            raise ValueError(
                f"{golden.path}: '# {key}: {found}' but this run has {key} {expected!r}; "
                f"the file belongs to another configuration, or {_REGENERATE}"
            )


def write_golden(path: Union[str, Path], header: dict[str, str], rows: list[tuple[int, float, float]]) -> None:
    """Write atomically (a temporary file in the same folder, then rename), creating parent folders."""
    path = Path(path)
    for step, *values in rows:
        for name, value in zip(COLUMNS[1:], values):
            if not math.isfinite(value):
                raise ValueError(f"refusing to write {path}: step {step} has non-finite {name} {value!r}")
    lines = [f"# {key}: {value}" for key, value in header.items()]
    lines.append("# " + " ".join(COLUMNS))
    lines += [" ".join([str(step)] + [repr(float(v)) for v in values]) for step, *values in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class GoldenNumerics(L.Callback):
    """Record step, loss (``train/loss``, the mean over data-parallel ranks) and global grad norm
    (``pl_module.last_grad_norm``) after every optimizer step.

    ``mode="compare"`` reads ``path`` at setup and checks each step for exact equality as it
    goes, raising AssertionError at the first difference; at train end the number of steps
    must match the file. ``mode="export"`` writes ``path`` at train end on global rank 0,
    with a header naming ``config_name`` (default: the module's class name), the world size
    and the parallel layout.
    """

    def __init__(
        self,
        path: Union[str, Path],
        mode: Literal["compare", "export"] = "compare",
        *,
        config_name: Optional[str] = None,
    ) -> None:
        if mode not in ("compare", "export"):
            raise ValueError(f"GoldenNumerics(mode={mode!r}): expected 'compare' or 'export'")
        self.path = Path(path)
        self.mode = mode
        self.config_name = config_name
        self.golden: Optional[Golden] = None
        self.rows: list[tuple[int, float, Optional[float]]] = []

    @property
    def _needs_grad_norm(self) -> bool:
        return self.mode == "export" or not self.golden.legacy

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.rows = []
        if self.mode == "compare":
            if not self.path.is_file():
                raise FileNotFoundError(f"golden numerics file {self.path} does not exist; {_REGENERATE}")
            self.golden = read_golden(self.path)
            header = self.header(trainer, pl_module)
            check_header(self.golden, ngpu=int(header["ngpu"]), parallelism=header["parallelism"],
                         hardware=header["hardware"])
        if self._needs_grad_norm and not hasattr(pl_module, "last_grad_norm"):
            raise AttributeError(
                f"GoldenNumerics needs the global grad norm, and {type(pl_module).__name__} has no "
                f"`last_grad_norm` attribute; set it before each optimizer step (as CausalLMModule's "
                f"configure_gradient_clipping does)"
            )

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not ends_optimizer_step(trainer, batch_idx):
            return
        step = trainer.global_step
        if "train/loss" not in trainer.callback_metrics:
            raise KeyError(
                f"GoldenNumerics reads the logged 'train/loss', which {type(pl_module).__name__} "
                f"did not log at step {step}"
            )
        loss = trainer.callback_metrics["train/loss"].item()
        norm = None
        if self._needs_grad_norm:
            tensor = getattr(pl_module, "last_grad_norm", None)
            if tensor is None:
                raise RuntimeError(
                    f"{type(pl_module).__name__}.last_grad_norm is None at step {step}: no grad norm was recorded "
                    f"before the optimizer step"
                )
            norm = float(tensor.item() if hasattr(tensor, "item") else tensor)
        for name, value in (("loss", loss), ("grad_norm", norm)):
            if value is not None and not math.isfinite(value):
                raise FloatingPointError(
                    f"non-finite {name} {value!r} at step {step}; a golden file never holds or accepts NaN or inf"
                )
        self.rows.append((step, loss, norm))
        if self.mode == "compare":
            self._compare(step, loss, norm)

    def _compare(self, step: int, loss: float, norm: Optional[float]) -> None:
        golden = self.golden
        index = len(self.rows) - 1
        if index >= len(golden.steps):
            return  # more steps than the file: reported at train end
        if golden.steps[index] != step:
            raise AssertionError(
                f"golden numerics {self.path}: optimizer step #{index + 1} is global step {step}, "
                f"but the file's line #{index + 1} is step {golden.steps[index]}"
            )
        quantities = [("loss", golden.losses[index], loss)]
        if golden.grad_norms is not None:
            quantities.append(("grad_norm", golden.grad_norms[index], norm))
        why = comparable(golden, golden.header.get("hardware", "cpu"))
        other_torch = f" (the file was {why})" if why else ""
        for name, expected, got in quantities:
            if got != expected:
                raise AssertionError(
                    f"golden numerics {self.path}: step {step} {name} differs: expected {expected!r}, got {got!r} "
                    f"(difference {got - expected:+.3e}){other_torch}; if the change is intended, {_REGENERATE}"
                )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.mode == "compare":
            ran, expected = len(self.rows), len(self.golden.steps)
            if ran != expected:
                raise AssertionError(
                    f"golden numerics {self.path}: {'fewer' if ran < expected else 'more'} steps ran ({ran}) "
                    f"than the file has ({expected}); match trainer.max_steps to the file or {_REGENERATE}"
                )
            return
        if trainer.is_global_zero:
            write_golden(self.path, self.header(trainer, pl_module), self.rows)

    def header(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, str]:
        dims = getattr(trainer.strategy, "dims", None)
        hardware = hardware_class(trainer.strategy.root_device.type)
        header = {
            "config": self.config_name or type(pl_module).__name__,
            "ngpu": str(trainer.world_size),
            "parallelism": dims.describe() if dims is not None else "single device",
            "hardware": hardware,
            "torch": torch_version(),
        }
        if hardware == "cpu":
            header["cpu"], model = cpu_vendor(), cpu_model()
            if model is not None:
                header["cpu_model"] = model
        return header
