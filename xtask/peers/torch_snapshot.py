"""Peers of `ironweave bench snapshot`: torch.save and torchsnapshot on the same layout.

Usage: python torch_snapshot.py BYTES REPEAT DIR  -> prints one JSON object.
Layout as ironweave's: 60% in 8 large f32 tensors, 30% in 256 KiB tensors, 10% in 4 KiB tensors.
"""
import json, os, shutil, sys, time

import torch
import torchsnapshot

total, repeat, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.makedirs(out, exist_ok=True)
tensors = {}
large = total * 6 // 10 // 8 // 4
for i in range(8):
    tensors[f"large.{i}"] = torch.full((large,), float(i + 1), dtype=torch.float32)
mid = (total * 3 // 10) // (256 << 10)
for i in range(mid):
    tensors[f"mid.{i}"] = torch.full(((256 << 10) // 4,), 1.0, dtype=torch.float32)
used = large * 4 * 8 + mid * (256 << 10)
for i in range(max(0, total - used) // 4096):
    tensors[f"small.{i}"] = torch.full((1024,), 2.0, dtype=torch.float32)
nbytes = sum(t.numel() * 4 for t in tensors.values())


def best(f):
    b = float("inf")
    for _ in range(max(1, repeat)):
        t = time.perf_counter()
        f()
        b = min(b, time.perf_counter() - t)
    return b


warm = {k: torch.empty_like(v) for k, v in tensors.items()}


def copy_warm():
    for k, v in tensors.items():
        warm[k].copy_(v)


path = os.path.join(out, "state.pt")


def save():
    with open(path, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())


class State:
    def __init__(self, d):
        self.d = d

    def state_dict(self):
        return self.d

    def load_state_dict(self, sd):
        self.d = sd


snap_dir = os.path.join(out, "torchsnapshot")


def take():
    shutil.rmtree(snap_dir, ignore_errors=True)
    torchsnapshot.Snapshot.take(path=snap_dir, app_state={"state": State(tensors)})


res = {
    "bytes": nbytes,
    "tensors": len(tensors),
    "torch_copy_warm_s": best(copy_warm),
    "torch_save_s": best(save),
    "torchsnapshot_take_s": best(take),
    "torch": torch.__version__,
}
os.remove(path)
shutil.rmtree(snap_dir, ignore_errors=True)
print(json.dumps(res))
