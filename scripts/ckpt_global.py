#!/usr/bin/env python3
"""Read the global tensors of an ironweave checkpoint from its files and manifests alone.

    python3 scripts/ckpt_global.py DIR [--iter N]

DIR is a persistent tier (`<report dir>/persist`). For the iteration (default: the newest one
whose every rank wrote its manifest) the script reads each rank's `rank-R.json` manifest and
`rank-R.safetensors` file, assembles every global tensor from its owner slices (checking each
slice's checksum-free bytes land inside the tensor, exactly once), and prints the layout-free
digest `ironweave ckpt inspect` and `report.json`'s `global_state_sha256` give: SHA-256 over the
global tensors sorted by name, each as its name, a zero byte and the SHA-256 of its bytes in
row-major order. Standard library only.
"""
import hashlib
import json
import os
import struct
import sys


def manifests(d, it):
    first = json.load(open(os.path.join(d, f"iter-{it:08d}", "rank-00000.json")))
    out = [first]
    for r in range(1, first["world"]):
        out.append(json.load(open(os.path.join(d, f"iter-{it:08d}", f"rank-{r:05d}.json"))))
    return out


def complete(d):
    its = sorted((int(n[5:]) for n in os.listdir(d) if n.startswith("iter-")), reverse=True)
    for it in its:
        try:
            manifests(d, it)
            return it
        except (OSError, ValueError):
            continue
    raise SystemExit(f"{d}: no iteration with every rank's manifest")


SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "U32": 4, "U64": 8, "BOOL": 1}


def main():
    args = sys.argv[1:]
    if not args:
        raise SystemExit(__doc__)
    d = args[0]
    it = int(args[args.index("--iter") + 1]) if "--iter" in args else complete(d)
    mans = manifests(d, it)
    tensors = {}  # name -> (dtype, shape, bytearray, covered elements)
    for r, m in enumerate(mans):
        path = os.path.join(d, f"iter-{it:08d}", f"rank-{r:05d}.safetensors")
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            start = 8 + n
            for t in m["registry"]["tensors"]:
                g = t.get("global")
                if g is None:
                    raise SystemExit(f"{path}: tensor {t['name']} has no global slice")
                if not g["owner"]:
                    continue
                es = SIZES[t["dtype"]]
                shape, off, ext = g["shape"], g["offsets"], t["shape"]
                vol = 1
                for x in shape:
                    vol *= x
                name = g["tensor"]
                buf = tensors.setdefault(name, [t["dtype"], shape, bytearray(vol * es), 0])
                f.seek(start + t["offset"])
                data = f.read(t["len"])
                if len(data) != t["len"]:
                    raise SystemExit(f"{path}: tensor {name} truncated")
                # row-major copy of the slice's rows into the global tensor
                nd = len(shape)
                row = (ext[-1] if nd else 1) * es
                strides = [1] * nd
                for k in range(nd - 2, -1, -1):
                    strides[k] = strides[k + 1] * shape[k + 1]
                lead = ext[:-1] if nd else []
                count = 1
                for x in lead:
                    count *= x
                for i in range(count):
                    idx, rest = [], i
                    for x in reversed(lead):
                        idx.append(rest % x)
                        rest //= x
                    idx = list(reversed(idx))
                    pos = sum((off[k] + idx[k]) * strides[k] for k in range(nd - 1)) + (off[-1] if nd else 0)
                    buf[2][pos * es:pos * es + row] = data[i * row:(i + 1) * row]
                buf[3] += len(data) // es
    h = hashlib.sha256()
    for name in sorted(tensors):
        dtype, shape, data, covered = tensors[name]
        if covered != len(data) // SIZES[dtype]:
            raise SystemExit(f"tensor {name}: the owner slices cover {covered} of {len(data) // SIZES[dtype]} elements")
        h.update(name.encode())
        h.update(b"\0")
        h.update(hashlib.sha256(bytes(data)).digest())
    print(f"iteration {it}: {len(tensors)} global tensors from {len(mans)} files")
    print(f"global_state_sha256 {h.hexdigest()}")


if __name__ == "__main__":
    main()
