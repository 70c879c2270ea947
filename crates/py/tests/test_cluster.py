"""The Python package on several nodes and with refusals, on real processes: torchrun agents
as emulated nodes (``IRONWEAVE_HOST`` per agent, c10d rendezvous), ranks that refuse while
their peers wait, kept copies that someone else planted.

Run by scripts/test.sh after the cargo tests (it builds and installs the wheel first)."""

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ironweave
from test_torch import JOB, clean_run, ranks, torchrun, world_of_one  # noqa: F401  (fixtures)

HERE = Path(__file__).resolve().parent
REFUSE = HERE / "refuse_job.py"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(script, out, node, nproc, nnodes, port, run_id, restarts=1, **env):
    """One torchrun agent for the emulated node `node` (IRONWEAVE_HOST), `nproc` ranks, meeting
    the others in a c10d rendezvous at 127.0.0.1:`port`; in a session of its own, so the agent
    and its workers can be killed together."""
    # torch 2.15's agents share a store that a rank-0 agent kept from an earlier round does not
    # announce to a new agent (the new node waits for MASTER_ADDR forever): each round gets its own
    e = dict(os.environ, OUT=str(out), IRONWEAVE_HOST=node, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
             **{k: str(v) for k, v in env.items()})
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "IRONWEAVE_RANK", "IRONWEAVE_KEEP_DIR",
              "IRONWEAVE_CKPT_PORT", "IRONWEAVE_SECRET"):
        e.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}",
           # a lost node's heartbeat stops: it leaves the rendezvous after 3 s, not 30
           "--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3",
           f"--max-restarts={restarts}", str(script)]
    return subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def descendants(pid):
    """Every process below `pid` (torchrun starts its workers in sessions of their own, so a
    process group does not reach them)."""
    children = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_node(p):
    """SIGKILLs an agent and every process it started: the node is lost."""
    procs = [p.pid] + descendants(p.pid)
    for pid in procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finished(p, timeout=600):
    try:
        outp, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        outp, _ = p.communicate()
    return p.returncode, outp


def progress(out, n):
    got = {}
    for r in range(n):
        try:
            got[r] = json.loads((Path(out) / f"progress-{r}.json").read_text())
        except (OSError, ValueError):
            pass
    return got


def test_a_lost_node_is_replaced_and_its_ranks_restore_from_the_other_node_s_memory(tmp_path, clean_run):
    """Two torchrun agents (nodes a and b, 2 ranks each, c10d rendezvous). Past step 10 node b's
    agent and workers are SIGKILLed and node b's kept copies deleted (its memory is gone); a new
    agent for node b joins, torchrun restarts the job, node b's ranks restore from node a's
    memory, and the job ends bit for bit in the clean 4-rank run's state. Every replica byte
    crossed between the nodes (on the old package: none did)."""
    run_id = f"ironweave-pytest-2node-{os.getpid()}"
    keep = Path("/dev/shm") / f"ironweave-{run_id}" / "checkpointer-0"
    shutil.rmtree(keep.parent, ignore_errors=True)
    port = free_port()
    env = dict(STEPS=20, STEP_SLEEP=0.25, PROGRESS=1)
    a = agent(JOB, tmp_path, "a", 2, 2, port, run_id, **env)
    time.sleep(0.5)  # the first agent hosts the rendezvous store
    b = agent(JOB, tmp_path, "b", 2, 2, port, run_id, **env)
    try:
        deadline = time.monotonic() + 300
        while True:
            p = progress(tmp_path, 4)
            if len(p) == 4 and all(x["step"] >= 10 and x["attempt"] == 0 for x in p.values()):
                break
            assert time.monotonic() < deadline and a.poll() is None and b.poll() is None, \
                f"the job did not reach step 10: {p}\n{finished(a, 5)[1][-3000:]}\n{finished(b, 5)[1][-3000:]}"
            time.sleep(0.05)
        kill_node(b)  # node b is lost: its agent and its workers
        finished(b, 30)
        lost = sorted(r for r, x in p.items() if x["host"] == "b")
        assert len(lost) == 2, p
        for r in lost:
            shutil.rmtree(keep / f"holder-{r:05d}", ignore_errors=True)
        time.sleep(5)  # the lost node leaves the rendezvous (its heartbeat is 3 s overdue)
        b2 = agent(JOB, tmp_path, "b", 2, 2, port, run_id, **env)  # a new node b joins
        rc_a, out_a = finished(a)
        rc_b, out_b = finished(b2)
        assert rc_a == 0 and rc_b == 0, f"{out_a[-4000:]}\n{out_b[-4000:]}"
        rs = ranks(tmp_path)
        digest = clean_run[0]["digest"]
        assert [r["digest"] for r in rs] == [digest] * 4, "the final state differs from the clean run's"
        host_of = {i: r["host"] for i, r in enumerate(rs)}
        assert sorted(host_of.values()) == ["a", "a", "b", "b"], host_of
        # every rank runs the handshake with the secret rank 0 published (on the old package:
        # an empty one, and a warning)
        secrets_seen = {r["secret"] for r in rs}
        assert len(secrets_seen) == 1 and secrets_seen != {hashlib.sha256(b"").hexdigest()}, secrets_seen
        for i, r in enumerate(rs):
            src = r["restored"]
            assert src is not None, f"rank {i} started over"
            if i in lost:
                # its node's copies are gone: its state came from a rank on the other node
                assert src["source"] == "peer" and host_of[src["peer"]] != host_of[i], (i, src, host_of)
            st = r["stats"]
            # replicas go to the other node only: every replica byte crossed between them
            assert st["replica_bytes_sent"] > 0 and st["replica_bytes_inter_host"] == st["replica_bytes_sent"], st
        assert not keep.parent.exists(), "the job's kept copies outlived its clean end"
    finally:
        for p in (a, b):
            if p.poll() is None:
                kill_node(p)
        shutil.rmtree(keep.parent, ignore_errors=True)


@pytest.mark.parametrize("nproc", [2, 4])
def test_a_refusal_on_one_rank_is_every_rank_s_typed_error_at_once(tmp_path, nproc):
    """The last rank refuses (a repeated step, a negative step, a changed state, values over
    extras_bytes, a mismatch at restore) and stays alive until its peers have their error; every
    rank raises the same typed error, and the checkpointer goes on afterwards. On the old package
    the peers sat in the commit until the refusing rank's next call and then saw a generic
    IronweaveError (or waited out timeout_s)."""
    p = torchrun(REFUSE, tmp_path, nproc=nproc, restarts=0)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    rs = [json.loads((tmp_path / f"refuse-{r}.json").read_text()) for r in range(nproc)]
    cases = rs[0]["cases"].keys()
    assert set(cases) == {"repeated step", "negative step", "changed state", "over-size extra", "restore mismatch"}
    for case in cases:
        got = [r["cases"][case] for r in rs]
        kinds = {g["type"] for g in got}
        msgs = {g["message"] for g in got}
        assert len(kinds) == 1 and len(msgs) == 1, (case, got)
        kind = kinds.pop()
        want = "StateMismatchError" if case in ("changed state", "restore mismatch") else "ConfigurationError"
        assert kind == want, (case, got)
        assert f"rank {nproc - 1}" in msgs.pop(), (case, got)
        # the peers had their error before the refusing rank went on (it waits for them)
        assert all(g["before_refuser_went_on"] for g in got[:-1]), (case, got)
        assert all(g["is_value_error"] for g in got), (case, got)
    # the checkpointer works after every refusal: a last save on every rank
    assert all(r["final_save"] == 100 for r in rs), rs


def test_a_planted_copy_and_an_open_directory_are_refused(world_of_one, tmp_path):
    """Kept copies carry a MAC (HMAC-SHA256 under the job's key, kept 0600 beside them): a copy
    planted with valid xxh3 checksums and the right job id but no valid MAC is never adopted;
    a keep directory another user could write is refused before training."""
    keep = Path(os.environ["IRONWEAVE_KEEP_DIR"]) / "checkpointer-0"
    w = torch.zeros(8)
    ck = ironweave.torch.Checkpointer({"w": w})
    with torch.no_grad():
        w.fill_(7.0)
    ck.save(1)
    ck.save(2)
    ck.close(remove_kept=False)
    files = sorted(keep.rglob("*.json"))
    assert files and all(json.loads(f.read_text()).get("mac") for f in files), files
    assert oct(keep.stat().st_mode & 0o777) == "0o700" and oct((keep / "mac-key").stat().st_mode & 0o777) == "0o600"
    assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in files)
    segments = sorted(keep.rglob("*.seg"))  # the snapshot and replica buffers: the kept copies
    assert segments and all(oct(f.stat().st_mode & 0o777) == "0o600" for f in segments), segments
    # the same job comes back: its own copies restore (the MAC holds)
    world_of_one()
    with torch.no_grad():
        w.zero_()
    ck = ironweave.torch.Checkpointer({"w": w})
    assert ck.restore()["step"] == 2 and torch.equal(w, torch.full((8,), 7.0))
    ck.close(remove_kept=False)
    # a planter writes copies of steps 3 and 4 for this job id (valid checksums: written by an
    # engine, under a key of its own) into the job's holder directory
    world_of_one()
    other = tmp_path / "planter"
    with torch.no_grad():
        w.fill_(666.0)
    ck = ironweave.torch.Checkpointer({"w": w}, keep_dir=str(other))
    ck.save(3)
    ck.save(4)
    ck.close(remove_kept=False)
    # (the manifests: each names a segment of the holder directory, which the victim has too)
    for it in sorted(p for p in (other / "holder-00000").iterdir() if p.is_dir()):
        shutil.copytree(it, keep / "holder-00000" / it.name)
    world_of_one()
    with torch.no_grad():
        w.zero_()
    ck = ironweave.torch.Checkpointer({"w": w})
    info = ck.restore()
    assert info["step"] == 2 and torch.equal(w, torch.full((8,), 7.0)), info
    fails = ck.stats()["failures"]
    assert sum("MAC" in f for f in fails) >= 2, fails
    ck.close()
    # a keep directory open to others is refused before training
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    world_of_one()
    with pytest.raises(ironweave.ConfigurationError, match="700"):
        ironweave.torch.Checkpointer({"w": w}, keep_dir=str(open_dir))


def test_pytorch_conventions_hooks_tied_weights_lbfgs_schedulers_and_named_optimizer_state(world_of_one):
    """watch()'s hooks leave in-place operations working, warn of nothing, and go with
    close(); tied weights are saved once; LBFGS (a closure optimizer) is accepted; an LR
    scheduler comes back through load_state_dict into the user's object; optimizer state is
    keyed by parameter names, so a changed parameter order restores correctly; errors are
    also the builtins they mean; DCP's path-like ids name a step."""
    import warnings

    from ironweave.dcp import _step_of

    assert issubclass(ironweave.ConfigurationError, ValueError)
    assert issubclass(ironweave.StateMismatchError, ValueError)
    assert issubclass(ironweave.ClosedError, RuntimeError)
    assert issubclass(ironweave.CheckpointTimeoutError, TimeoutError)
    assert _step_of("/ckpt/step_100") == 100 and _step_of(Path("run/7")) == 7

    # hooks: an in-place ReLU after a watched layer, inputs that need no gradient
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ck = ironweave.torch.Checkpointer({"model": net, "optim": opt}).watch(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net(torch.randn(2, 4)).sum().backward()
        opt.step()
        ck.save(1)
    assert ck.stats()["profiled_steps"] >= 0
    ck.close()
    net(torch.randn(2, 4)).sum().backward()  # after close: no ClosedError from a hook

    # tied weights: one storage, two keys, saved once
    world_of_one()
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    tied = torch.nn.ModuleDict({"emb": emb, "head": head})
    ck = ironweave.torch.Checkpointer({"model": tied})
    assert ck.stats()["state_bytes"] == 10 * 4 * 4 + 8 + (1 << 16), ck.stats()["state_bytes"]
    ck.close()

    # LBFGS: the optimizer's state is made with a closure; its growing history travels as values
    world_of_one()
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    lb = torch.optim.LBFGS([w], lr=0.5, history_size=3, max_iter=2)
    ck = ironweave.torch.Checkpointer({"w": w, "lbfgs": lb})

    def closure():
        lb.zero_grad()
        loss = (w ** 2).sum()
        loss.backward()
        return loss

    for step in (1, 2):
        lb.step(closure)
        ck.save(step)
    ck.close()

    # a scheduler and an optimizer whose parameters come back in another order
    world_of_one()
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(5))
    mod = torch.nn.Module()
    mod.a, mod.b = a, b
    opt = torch.optim.AdamW([a, b], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ck = ironweave.torch.Checkpointer({"model": mod, "optim": opt, "sched": sched})
    for step in (1, 2, 3):
        (a.sum() * 2 + b.sum() * 3).backward()
        opt.step()
        sched.step()
        ck.save(step)
    want_a = opt.state[a]["exp_avg"].clone()
    want_b = opt.state[b]["exp_avg"].clone()
    ck.close(remove_kept=False)
    world_of_one()
    opt2 = torch.optim.AdamW([b, a], lr=0.1)  # the other order
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    ck = ironweave.torch.Checkpointer({"model": mod, "optim": opt2, "sched": sched2})
    assert ck.restore()["step"] == 3
    assert torch.equal(opt2.state[a]["exp_avg"], want_a) and torch.equal(opt2.state[b]["exp_avg"], want_b)
    assert sched2.last_epoch == 3 and abs(opt2.param_groups[0]["lr"] - 0.1 * 0.5 ** 3) < 1e-12
    ck.close()


@pytest.mark.parametrize("corrupt,source", [("own", "peer"), ("all", "persistent")])
def test_a_copy_that_fails_its_check_is_never_loaded_and_the_restore_falls_back_a_tier(tmp_path, clean_run, corrupt, source):
    """Rank 1 dies at step 13; when it comes back its own kept copies (or every kept copy of its
    state) fail their checksums: they are passed over, never loaded, and its state comes from the
    next tier — a peer's copy, else the persistent tier — named in the log; the job ends bit for
    bit in the clean run's state after one restart (a corrupt copy never loops the job)."""
    persist = tmp_path / "persist"
    out = tmp_path / "out"
    out.mkdir()
    p = torchrun(JOB, out, STEPS=20, FAIL_RANK=1, FAIL_STEP=13, CORRUPT=corrupt, PERSIST_DIR=persist, PERSIST_EVERY=5)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    rs = ranks(out)
    assert [r["digest"] for r in rs] == [clean_run[0]["digest"]] * 4
    assert all(r["attempt"] == 1 for r in rs)
    assert rs[1]["restored"]["source"] == source, rs[1]["restored"]
    if source == "peer":
        assert rs[1]["restored"]["peer"] != 1
    assert f"rank 1 restored step {rs[1]['restored']['step']} from {source}" in p.stderr + p.stdout


def test_a_job_never_takes_another_job_s_copies_and_orphans_are_cleaned(tmp_path):
    """Two jobs under torchrun's static rendezvous (run id `none` for both). The first dies out
    of restarts and leaves its copies; they are an orphan (`python -m ironweave clean --dry-run`
    lists them); the second starts fresh — on the old package both used /dev/shm/ironweave-none
    and the second resumed the first — and its rank 0 removes the orphan before it takes room."""
    from test_torch import shm_dirs

    before = shm_dirs()
    first = tmp_path / "first"
    first.mkdir()
    p = torchrun(JOB, first, nproc=2, restarts=0, master_port=free_port(), STEPS=6, FAIL_RANK=1, FAIL_STEP=4)
    assert p.returncode != 0
    left = shm_dirs() - before
    assert len(left) == 1, left
    (orphan,) = left
    assert "none" not in orphan, orphan
    listed = subprocess.run([sys.executable, "-m", "ironweave", "clean", "--dry-run"], capture_output=True, text=True)
    assert listed.returncode == 0 and f"orphan   /dev/shm/{orphan}" in listed.stdout, listed.stdout
    assert (Path("/dev/shm") / orphan).exists()
    second = tmp_path / "second"
    second.mkdir()
    p = torchrun(JOB, second, nproc=2, restarts=0, master_port=free_port(), STEPS=6)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    assert all(r["restored"] is None for r in ranks(second, 2)), "the second job took the first's copies"
    assert shm_dirs() - before == set(), "the orphan (or the second job's copies) is still there"


def test_fsdp2_state_is_saved_as_local_shards_and_loads_onto_another_world_size(tmp_path):
    """FSDP2 (``fully_shard``, DTensors, gloo on CPU), 2 ranks: each rank saves its local shards
    with their global place (on the old package the spec took the global shape and the local
    bytes, and the state did not fit), restores them in place, and one process loads the whole
    model from the kept copies through ``PeerMemoryReader`` (DCP's ``load``)."""
    import torch.distributed.checkpoint as dcp

    from ironweave.dcp import PeerMemoryReader

    keep = Path("/dev/shm") / f"ironweave-pytest-fsdp-{os.getpid()}"
    shutil.rmtree(keep, ignore_errors=True)
    try:
        p = torchrun(HERE / "fsdp_job.py", tmp_path, nproc=2, restarts=0, KEEP=keep)
        assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
        for r in range(2):
            rep = json.loads((tmp_path / f"fsdp-{r}.json").read_text())
            assert rep["restored"]["step"] == 3 and rep["same"] and rep["same_optim"], rep
            # a rank keeps its shards, not the whole model (and the optimizer's two moments)
            assert rep["state_bytes"] < 3 * 2 * (5 * 3 + 3 + 3 * 2 + 2) * 4 + (1 << 16) + 8 * 100, rep
        ref = torch.load(tmp_path / "ref.pt")
        model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
        sd = {"model": model.state_dict()}
        dcp.load(sd, storage_reader=PeerMemoryReader(keep))
        for k, v in model.state_dict().items():
            assert torch.equal(v, ref[k]), k
    finally:
        shutil.rmtree(keep, ignore_errors=True)


def test_cuda_state_goes_through_pinned_buffers_and_other_devices_are_refused(world_of_one):
    """A tensor on a device other than the CPU or CUDA is refused with a clear error (every
    rank); CUDA tensors are copied to pinned host buffers on a side stream and restored with one
    host-to-device copy — run where a GPU exists, skipped (visibly) elsewhere."""
    with pytest.raises(ironweave.ConfigurationError, match="meta"):
        ironweave.torch.Checkpointer({"w": torch.empty(4, device="meta")})
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the pinned-buffer path runs only where a GPU exists")
    world_of_one()
    w = torch.arange(16, dtype=torch.float32, device="cuda")
    ck = ironweave.torch.Checkpointer({"w": w})
    ck.save(1)
    ck.close(remove_kept=False)
    world_of_one()
    with torch.no_grad():
        w.zero_()
    ck = ironweave.torch.Checkpointer({"w": w})
    assert ck.restore()["step"] == 1
    assert torch.equal(w.cpu(), torch.arange(16, dtype=torch.float32))
    ck.close()
