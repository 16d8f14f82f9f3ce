"""Cost of checkpoint checksums (issue #35): crc32 while writing (a DCP save of GIB GiB of fp32
tensors, with and without the counting stream; best of 2) and the check before launch
(``check_files`` over the saved folder, files in the page cache: the crc32, not the disk)::

    GIB=1 python -m benchmarks.checksums /tmp/checksum_bench    # the folder is removed afterwards
"""
import os, shutil, sys, time, zlib
from pathlib import Path
import torch, torch.distributed.checkpoint as dcp
from titan_lightning import checkpoint as ckpt
from titan_lightning.checkpoint.writer import _ChecksummingWriter

root = Path(sys.argv[1]); shutil.rmtree(root, ignore_errors=True); root.mkdir(parents=True)
gib = int(float(os.environ.get("GIB", "1")) * (1 << 30))
state = {"state_dict": {f"w{i}": torch.randn(gib // 4 // 16 // 4096, 4096) for i in range(16)}}
def save(path, writer):
    t = time.perf_counter(); dcp.save(state, checkpoint_id=str(path), storage_writer=writer); return time.perf_counter() - t
plain = min(save(root / f"plain{i}", dcp.FileSystemWriter(str(root / f"plain{i}"))) for i in range(2))
counted = min(save(root / f"crc{i}", _ChecksummingWriter(root / f"crc{i}", {})) for i in range(2))
w = _ChecksummingWriter(root / "m", {}); save(root / "m", w)
manifest = {"files": w.checksums}
size = sum(v[0] for v in w.checksums.values())
os.system(f"cat {root}/m/* > /dev/null")  # page cache warm: the disk's speed is not what is measured
t = time.perf_counter(); ckpt.check_files(root / "m", manifest, checksums=True); verify = time.perf_counter() - t
t = time.perf_counter(); ckpt.check_files(root / "m", manifest, checksums=False); sizes = time.perf_counter() - t
mb = size / 1e6
print(f"bytes {size}  save plain {mb/plain:.0f} MB/s  save with crc32 {mb/counted:.0f} MB/s  "
      f"verify (crc32, {len(w.checksums)} files) {mb/verify:.0f} MB/s  sizes only {sizes*1000:.1f} ms")
shutil.rmtree(root)
