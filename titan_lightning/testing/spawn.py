"""Run a plain function on N real ranks (gloo), for tests below the Trainer.

    from titan_lightning.testing.spawn import run_function
    results = run_function("tests.unit_tests.cpu.cp_cases:attention_parity", 4, out_dir=tmp, timeout=120,
                           backend="ring")

Each rank is ``python -m titan_lightning.testing.spawn --out DIR -- module:function KWARGS_JSON``
started by ``launch`` (same environment, timeout and kill rules). The rank initializes the
default process group (gloo; or leaves it to the function, ``init_process_group=False``), calls ``function(rank=..., world_size=..., **kwargs)`` and
writes its JSON-able return value to ``DIR/rank{r}.json``; then barrier, destroy, ``os._exit``.
"""

import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

from titan_lightning.testing.launch import launch

MODULE = "titan_lightning.testing.spawn"


# "0": the rank does not start the process group (the function's Trainer does, as in a user's script).
INIT_ENV = "TITAN_LIGHTNING_SPAWN_INIT"


def run_function(
    target: str, world_size: int, *, out_dir: Path, timeout: float, env: Optional[dict] = None,
    init_process_group: bool = True, **kwargs: Any
) -> list[Any]:
    """Call ``target`` on ``world_size`` ranks; the list of what each rank returned.

    ``env`` adds to each rank's environment (e.g. PYTHONPATH for a test-only module).
    ``init_process_group=False``: the function starts it itself (a Lightning Trainer does, from the
    torchrun-style environment each rank gets).
    """
    env = {**(env or {}), INIT_ENV: "1" if init_process_group else "0"}
    result = launch([target, json.dumps(kwargs)], world_size, out_dir=out_dir, timeout=timeout, module=MODULE,
                    env=env)
    return [rank["result"] for rank in result.ranks]


def main(argv: list[str]) -> None:
    import torch
    import torch.distributed as dist

    if len(argv) != 5 or argv[0] != "--out" or argv[2] != "--":
        print("usage: python -m titan_lightning.testing.spawn --out DIR -- module:function KWARGS_JSON", file=sys.stderr)
        os._exit(2)
    out, target, kwargs = Path(argv[1]), argv[3], json.loads(argv[4])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    try:
        module_name, _, name = target.partition(":")
        function = getattr(importlib.import_module(module_name), name)
        if os.environ.get(INIT_ENV, "1") != "0":
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        value = function(rank=rank, world_size=world_size, **kwargs)
        (out / f"rank{rank}.json.partial").write_text(json.dumps({"rank": rank, "result": value}))
        (out / f"rank{rank}.json.partial").replace(out / f"rank{rank}.json")
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        (out / f"rank{rank}.error").write_text(text)
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
