"""Per-step checkpointing of a PyTorch job: ironweave beside torch.save, DCP (sync, async with
a thread and with a process, to disk and to /dev/shm), measured side by side in one invocation.

    python3 benches/python/torch_ckpt.py --mb 100            # ~100 MB of state per rank
    python3 benches/python/torch_ckpt.py --mb 1000 --ranks 2

Each method runs as its own torchrun job of --ranks CPU ranks (gloo): a model of P fp32
parameters trained by AdamW (state = parameters + two moments = --mb per rank), gradients
all-reduced each step (the training traffic the checkpoint competes with), and the method's
checkpoint after every step. Reported per method: the mean step time and its overhead over
no checkpointing, the time the loop is blocked per save (exposed), the bytes that crossed
between ranks for the checkpoint, and the bytes written to files. Then a recovery run per
method: rank 1 SIGKILLs itself mid-run (after dropping the page cache, so disk loads read the
disk), torchrun restarts every rank, and recovery is the time from the kill to the first
completed step after the load. ``ironweave (peer)`` deletes rank 1's kept copies before it
comes back (its host was lost), so rank 1 restores from a peer.

Rounds are interleaved (every method once, then again) and the median over rounds is shown.
Writes target/bench/torch-ckpt-<mb>mb.json. Needs torch and the ironweave wheel installed
(scripts/test.sh installs it).
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

METHODS = ["none", "torch.save", "dcp.save", "dcp.async_save (thread)", "dcp.async_save (process)",
           "dcp.save to /dev/shm", "ironweave", "ironweave (memory only)", "ironweave (dcp.save into PeerMemoryWriter)"]
RECOVERY = ["torch.save", "dcp.save", "dcp.save to /dev/shm", "ironweave", "ironweave (peer)",
            "ironweave (dcp.save into PeerMemoryWriter)"]
ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# the worker (one rank of one torchrun job)
# ---------------------------------------------------------------------------------------------

def worker():
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ironweave.torch import Checkpointer, init_process_group

    t_start = time.time()
    torch.set_num_threads(1)
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    method, mb, steps = os.environ["METHOD"], float(os.environ["MB"]), int(os.environ["STEPS"])
    out, disk, shm = Path(os.environ["OUT"]), Path(os.environ["DISK"]), Path(os.environ["SHM"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_step = int(os.environ.get("KILL_STEP", "0"))
    n = int(mb * 1e6 / 12)  # parameters; AdamW keeps two moments: 12 bytes each
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n // 4)) for _ in range(4)]
    optim = torch.optim.AdamW(params, lr=1e-4)
    work = torch.randn(256, 256)

    def step(k):
        # the "forward and backward": fixed arithmetic, then gradients all-reduced
        for _ in range(20):
            work.copy_(torch.tanh(work @ work * 1e-3))
        for p in params:
            p.grad = p.detach() * 1e-3 + k * 1e-6
            dist.all_reduce(p.grad)
        optim.step()

    state = {"params": {f"p{i}": p for i, p in enumerate(params)}, "optim": optim}
    if method == "torchft":
        # torchft's healing transfer: a live replica (rank 0) serves its state over HTTP, the
        # recovering one (rank 1) fetches it
        from datetime import timedelta

        from torchft.checkpointing import HTTPTransport

        for k in (1, 2):
            step(k)
        sd_ = {"params": [p.detach() for p in params], "optim": optim.state_dict()}
        tr = HTTPTransport(timeout=timedelta(seconds=120), num_chunks=0)
        meta = [tr.metadata()]
        dist.broadcast_object_list(meta, src=0)
        if rank == 0:
            tr.send_checkpoint([1], 2, sd_, timedelta(seconds=120))
        dist.barrier()
        t0 = time.time()
        if rank == 1:
            got = tr.recv_checkpoint(0, meta[0], 2, timedelta(seconds=120))
            assert all(torch.equal(a, b) for a, b in zip(got["params"], sd_["params"]))
        t1 = time.time()
        dist.barrier()
        tr.shutdown()
        nbytes = sum(p.numel() * 4 for p in params) + sum(
            v.numel() * v.element_size() for st in optim.state.values() for v in st.values() if torch.is_tensor(v))
        (out / f"rank{rank}-0.json").write_text(json.dumps({"rank": rank, "heal_s": t1 - t0, "bytes": nbytes}))
        return

    def sd():
        from torch.distributed.checkpoint.state_dict import get_state_dict

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.ps = torch.nn.ParameterList(params)

        m = M()
        msd, osd = get_state_dict(m, optim)
        return {"model": msd, "optim": osd}, m

    ck = None
    pg = None
    writer = None
    t_load0 = time.time()  # a restarted ironweave rank joins and adopts its kept copies first
    if method == "ironweave (dcp.save into PeerMemoryWriter)":
        from ironweave.dcp import PeerMemoryWriter

        writer = PeerMemoryWriter(keep_dir=str(shm / "keep"), timeout_s=120)
    elif method.startswith("ironweave"):
        keep = None if "memory only" in method else str(shm / "keep")
        ck = Checkpointer({**state["params"], "optim": optim}, keep_dir=keep, timeout_s=120)
    t_joined = time.time()
    if "async" in method:
        pg = dist.new_group(backend="gloo")
    start = 1
    loaded = None
    if attempt > 0:
        # recovery: load the newest checkpoint of the method
        if writer is not None:
            from ironweave.dcp import PeerMemoryReader
            from torch.distributed.checkpoint.state_dict import set_state_dict

            s, m = sd()
            reader = PeerMemoryReader(str(shm / "keep"))
            dcp.load(s, storage_reader=reader)
            set_state_dict(m, optim, model_state_dict=s["model"], optim_state_dict=s["optim"])
            start, loaded = reader.step + 1, {"source": "kept copies"}
        elif ck is not None:
            info = ck.restore()
            start, loaded = info["step"] + 1, info
        elif method == "torch.save":
            f = disk / f"rank{rank}.pt"
            s = torch.load(f, weights_only=False)
            with torch.no_grad():
                for p, q in zip(params, s["params"]):
                    p.copy_(q)
            optim.load_state_dict(s["optim"])
            start = s["step"] + 1
        else:
            d = (shm if "shm" in method else disk) / "dcp"
            step_file = d / "STEP"
            s, m = sd()
            dcp.load(s, checkpoint_id=str(d))
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(m, optim, model_state_dict=s["model"], optim_state_dict=s["optim"])
            start = int(step_file.read_text()) + 1
    t_loaded = time.time()
    step_times, exposed = [], []
    fut = None
    t_first_done = None
    for k in range(start, steps + 1):
        t0 = time.perf_counter()
        step(k)
        t1 = time.perf_counter()
        if attempt > 0 and t_first_done is None:
            t_first_done = time.time()
        if method == "torch.save":
            f = disk / f"rank{rank}.pt"
            torch.save({"params": [p.detach() for p in params], "optim": optim.state_dict(), "step": k}, str(f) + ".tmp")
            os.replace(str(f) + ".tmp", f)
        elif method in ("dcp.save", "dcp.save to /dev/shm"):
            d = (shm if "shm" in method else disk) / "dcp"
            s, _ = sd()
            dcp.save(s, checkpoint_id=str(d))
            if rank == 0:
                (d / "STEP").write_text(str(k))
        elif "async" in method:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            if fut is not None:
                fut.result()
            s, _ = sd()
            kind = AsyncCheckpointerType.PROCESS if "process" in method else AsyncCheckpointerType.THREAD
            fut = dcp.async_save(s, checkpoint_id=str(disk / "dcp"), process_group=pg, async_checkpointer_type=kind)
        elif ck is not None:
            ck.save(k)
        elif writer is not None:
            s, _ = sd()
            dcp.save(s, storage_writer=writer, checkpoint_id=k)
        t2 = time.perf_counter()
        step_times.append(t2 - t0)
        exposed.append(t2 - t1)
        if attempt == 0 and k == kill_step and rank == 1:
            (out / "kill").write_text(repr(time.time()))
            try:
                os.sync()
                Path("/proc/sys/vm/drop_caches").write_text("3")
            except OSError:
                pass
            os.kill(os.getpid(), signal.SIGKILL)
    if fut is not None:
        fut.result()
    dist.barrier()  # every rank's last save is whole before the files are counted
    files = sum(f.stat().st_size for d in (disk, shm) for f in d.rglob("*") if f.is_file())
    stats = ck.stats() if ck is not None else writer.stats() if writer is not None else {}
    rep = {
        "rank": rank, "attempt": attempt, "steps": step_times, "exposed": exposed, "files": files,
        "replica_bytes": stats.get("replica_bytes_sent", 0), "state_bytes": stats.get("state_bytes", 0),
        "passes_send": stats.get("memory_passes_send"), "passes_recv": stats.get("memory_passes_recv"),
        "t_start": t_start, "t_loaded": t_loaded, "load_s": t_loaded - t_load0, "join_s": t_joined - t_load0, "t_first_done": t_first_done,
        "restored": loaded,
    }
    (out / f"rank{rank}-{attempt}.json").write_text(json.dumps(rep))
    if ck is not None:
        ck.close()
    if writer is not None:
        writer.close()
    dist.barrier()


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------

def free_port():
    # below the ephemeral range, as the launcher picks its own: the restarted job listens on it
    # again, after the first one's connections were handed ports of that range
    from ironweave import _native

    return _native.free_port()


def run(method, args, base, kill_step=0):
    out, disk, shm = base / "out", base / "disk", Path("/dev/shm") / f"iw-bench-{os.getpid()}"
    for d in (base, shm):
        shutil.rmtree(d, ignore_errors=True)
    for d in (out, disk / "dcp", shm / "dcp"):
        d.mkdir(parents=True)
    env = dict(os.environ, METHOD=method, MB=str(args.mb), STEPS=str(args.steps), OUT=str(out), DISK=str(disk),
               SHM=str(shm), KILL_STEP=str(kill_step), IRONWEAVE_BENCH_WORKER="1", IRONWEAVE_CKPT_PORT=str(free_port()))
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "IRONWEAVE_KEEP_DIR"):
        env.pop(k, None)
    if method == "ironweave (peer)":
        env["IRONWEAVE_BENCH_LOSE_HOST"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
           f"--max-restarts={1 if kill_step else 0}", __file__]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    try:
        if p.returncode != 0:
            raise RuntimeError(f"{method}: torchrun failed\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
        reps = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
        kill = float((out / "kill").read_text()) if kill_step else None
        return reps, kill
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=100, help="state per rank, MB (parameters + AdamW moments)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12, help="steps per run; the first two are not timed")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kill-step", type=int, default=8)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--recovery", default=",".join(RECOVERY))
    ap.add_argument("--torchft", action="store_true", help="also time torchft's HTTP healing transfer (pip install torchft)")
    ap.add_argument("--work", default="/var/tmp/ironweave-bench-torch", help="where disk checkpoints go")
    ap.add_argument("--out", default=str(ROOT / "target" / "bench"))
    args = ap.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    recovery = [m for m in args.recovery.split(",") if m]
    for m in methods + recovery:
        if m not in METHODS + RECOVERY:
            sys.exit(f"unknown method {m!r}: one of {', '.join(METHODS + RECOVERY)}")
    base = Path(args.work)
    rows = {m: {"step": [], "exposed": [], "cross": [], "files": [], "passes": []} for m in methods}
    rec = {m: {"recovery": [], "load": []} for m in recovery}
    for r in range(args.rounds):
        for m in methods:
            reps, _ = run(m, args, base)
            per_rank_step = [statistics.mean(x["steps"][2:]) for x in reps]
            rows[m]["step"].append(max(per_rank_step))  # the job goes at its slowest rank's pace
            rows[m]["exposed"].append(max(statistics.mean(x["exposed"][2:]) for x in reps))
            rows[m]["cross"].append(sum(x["replica_bytes"] for x in reps) / len(reps[0]["steps"]))
            rows[m]["files"].append(max(x["files"] for x in reps))
            # the engine's memory passes per state byte (bytes it read and wrote over state
            # bytes), the worst rank as a sender and as a holder
            ps = [x["passes_send"] for x in reps if x.get("passes_send") is not None]
            pr = [x["passes_recv"] for x in reps if x.get("passes_recv") is not None]
            rows[m]["passes"].append((max(ps) if ps else None, max(pr) if pr else None))
            print(f"round {r + 1} {m}: step {rows[m]['step'][-1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
        for m in recovery:
            reps, kill = run(m, args, base, kill_step=args.kill_step)
            after = [x for x in reps if x["attempt"] == 1]
            rec[m]["recovery"].append(max(x["t_first_done"] for x in after) - kill)
            rec[m]["load"].append(max(x["load_s"] for x in after))
            rec[m].setdefault("join", []).append(max(x["join_s"] for x in after))
            src = [x["restored"]["source"] for x in after if x.get("restored")]
            rec[m]["source"] = src
            print(f"round {r + 1} recovery {m}: {rec[m]['recovery'][-1]:.2f} s {src}", file=sys.stderr, flush=True)
    heal = []
    if args.torchft:
        try:
            for _ in range(args.rounds):
                reps, _ = run("torchft", args, base)
                heal.append((max(x["heal_s"] for x in reps), reps[0]["bytes"]))
        except RuntimeError as e:
            print(f"torchft: not measured ({str(e).splitlines()[0]}); install it with "
                  "`pip install torchft==0.2.0 opentelemetry-sdk opentelemetry-exporter-otlp-proto-http`", file=sys.stderr)
    med = statistics.median
    base_step = med(rows["none"]["step"]) if "none" in rows else None
    result = {"mb": args.mb, "ranks": args.ranks, "steps": args.steps, "rounds": args.rounds,
              "rows": rows, "recovery": rec, "torchft_heal": heal, "cpu": os.cpu_count()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"torch-ckpt-{int(args.mb)}mb.json"
    path.write_text(json.dumps(result, indent=1))
    mean = statistics.mean
    print(f"| method ({args.mb:g} MB/rank, {args.ranks} ranks) | step (median / mean) | overhead vs none (median / mean) "
          "| exposed per save | bytes between ranks per save | files at the end (all ranks) "
          "| memory passes per state byte (sender / holder) |")
    print("|---|---|---|---|---|---|---|")
    base_mean = mean(rows["none"]["step"]) if "none" in rows else None
    for m in methods:
        s, sm = med(rows[m]["step"]), mean(rows[m]["step"])
        over = f"{(s / base_step - 1) * 100:+.0f}% / {(sm / base_mean - 1) * 100:+.0f}%" if base_step else "-"
        p = rows[m]["passes"][-1] if rows[m]["passes"] else (None, None)
        passes = " / ".join("-" if v is None else f"{v:.2f}" for v in p)
        print(f"| {m} | {s * 1e3:.0f} / {sm * 1e3:.0f} ms | {over} | {med(rows[m]['exposed']) * 1e3:.1f} ms | "
              f"{med(rows[m]['cross']) / 1e6:.1f} MB | {med(rows[m]['files']) / 1e6:.0f} MB | {passes} |")
    if recovery:
        print()
        print("| recovery (kill of rank 1 to the first completed step) | seconds | of which loading "
              "| of that, joining (ironweave: rendezvous, adopting kept copies) | restored from |")
        print("|---|---|---|---|---|")
        for m in recovery:
            srcs = ", ".join(sorted(set(rec[m].get("source", [])))) or "files"
            print(f"| {m} | {med(rec[m]['recovery']):.2f} | {med(rec[m]['load']):.2f} | {med(rec[m]['join']):.2f} | {srcs} |")
    if heal:
        print()
        print(f"torchft HTTPTransport, rank 1 fetching the state from live rank 0: {med([h[0] for h in heal]):.2f} s "
              f"for {heal[0][1] / 1e6:.0f} MB")
    print(f"\nwritten {path}", file=sys.stderr)


if __name__ == "__main__":
    if os.environ.get("IRONWEAVE_BENCH_WORKER") == "1":
        if os.environ.get("IRONWEAVE_BENCH_LOSE_HOST") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" \
                and os.environ.get("RANK") == "1":
            shutil.rmtree(Path(os.environ["SHM"]) / "keep" / "holder-00001", ignore_errors=True)
        worker()
        from ironweave.torch import finish

        finish()  # not a return into interpreter finalization: see ironweave.torch.finish
    else:
        main()
