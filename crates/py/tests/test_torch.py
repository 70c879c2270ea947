"""The Python package on real processes: torchrun jobs on 4 CPU ranks (gloo) checkpointed
every step by ironweave, killed and restarted; and the package's refusals of bad input.

Run by scripts/test.sh after the cargo tests (it builds and installs the wheel first)."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ironweave
from ironweave.torch import Checkpointer

HERE = Path(__file__).resolve().parent
JOB = HERE / "ddp_job.py"


def torchrun(script, out, nproc=4, restarts=2, master_port=None, **env):
    e = dict(os.environ, OUT=str(out), **{k: str(v) for k, v in env.items()})
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "IRONWEAVE_RANK", "IRONWEAVE_KEEP_DIR",
              "IRONWEAVE_CKPT_PORT"):
        if k not in env:
            e.pop(k, None)
    # torchrun's own rendezvous on a free port, or the static one on `master_port`
    where = ["--standalone"] if master_port is None else [
        "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={master_port}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={nproc}",
           f"--max-restarts={restarts}", str(script)]
    p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=600)
    return p


def ranks(out, n=4):
    return [json.loads((Path(out) / f"rank-{r}.json").read_text()) for r in range(n)]


def shm_dirs():
    return {p.name for p in Path("/dev/shm").glob("ironweave-*")} if Path("/dev/shm").is_dir() else set()


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """The DDP job without a failure under torchrun: every rank's report."""
    out = tmp_path_factory.mktemp("clean")
    p = torchrun(JOB, out, STEPS=20)
    assert p.returncode == 0, f"clean: torchrun failed\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return ranks(out)


def test_a_killed_rank_and_a_lost_host_end_bit_for_bit_in_the_clean_run_s_state(tmp_path, clean_run):
    before = shm_dirs()
    runs = {"clean": clean_run}
    for name, env in {
        # rank 1 SIGKILLs itself after the backward of step 13: torchrun restarts every worker,
        # and each restores from the copies it kept in /dev/shm
        "killed": {"FAIL_RANK": 1, "FAIL_STEP": 13},
        # the same, and rank 1's kept copies are gone when it comes back: its host was lost
        "host-lost": {"FAIL_RANK": 1, "FAIL_STEP": 13, "FAIL_HOST": 1},
    }.items():
        out = tmp_path / name
        out.mkdir()
        p = torchrun(JOB, out, STEPS=20, **env)
        assert p.returncode == 0, f"{name}: torchrun failed\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
        runs[name] = ranks(out)
    clean = runs["clean"]
    digest = clean[0]["digest"]
    assert all(r["digest"] == digest for r in clean), "the ranks of the clean run disagree"
    assert all(r["restored"] is None and r["attempt"] == 0 for r in clean)
    for name in ("killed", "host-lost"):
        rs = runs[name]
        assert all(r["attempt"] == 1 for r in rs), f"{name}: not restarted once"
        assert [r["digest"] for r in rs] == [digest] * 4, f"{name}: the final state differs from the clean run's"
        # the picklable value in the state came back with the tensors
        assert all(r["seen"] == 20 for r in rs)
        steps = {r["restored"]["step"] for r in rs}
        assert len(steps) == 1 and 10 <= steps.pop() <= 12, [r["restored"] for r in rs]
    assert [r["restored"]["source"] for r in runs["killed"]] == ["own memory"] * 4
    lost = [r["restored"] for r in runs["host-lost"]]
    assert lost[1]["source"] == "peer" and lost[1]["peer"] != 1, lost[1]
    assert [lost[r]["source"] for r in (0, 2, 3)] == ["own memory"] * 3
    # every rank's state crossed to its holder each step, and nothing is left in /dev/shm
    st = clean[0]["stats"]
    assert st["saves"] == 20 and st["committed"] == 19
    assert st["replica_bytes_sent"] >= 19 * st["state_bytes"]
    # the engine saw the steps: the layers' phases and DDP's all-reduces (4 gradients per step,
    # after the first save opened the engine's first step), and placed chunks by them
    for r in clean:
        s = r["stats"]
        assert s["profiled_steps"] >= 1 and s["training_comms"] >= 4 * 19 and s["chunks"] > 0, s
    assert shm_dirs() == before


def test_the_checkpointer_s_port_is_agreed_in_torchrun_s_store_not_taken_from_master_port_plus_one(tmp_path):
    # a socket already listens on MASTER_PORT + 1, where the checkpointer's rendezvous used to
    # go (a clean-clone CI run once failed there: "Address already in use")
    for _ in range(50):
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        master = taken.getsockname()[1] - 1
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", master))
                break
            except OSError:
                taken.close()
    else:
        pytest.fail("found no free port below a listening one in 50 tries")
    with taken:
        p = torchrun(JOB, tmp_path, nproc=2, restarts=0, master_port=master, STEPS=3)
    assert p.returncode == 0, f"torchrun failed\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    rs = ranks(tmp_path, n=2)
    assert rs[0]["digest"] == rs[1]["digest"]


def test_the_port_rank_0_publishes_lies_below_the_ephemeral_range_and_is_free():
    # below the range the kernel hands outgoing connections from: none of the job's own can
    # take it between rank 0's choice and its rendezvous listening there
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(3):
        port = ironweave._native.free_port()
        assert 10000 <= port < low, (port, low)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_watch_times_ddp_s_own_bucket_all_reduce_without_changing_a_bit(tmp_path):
    # plain DDP: watch replaces DDP's default averaging with the same bucket all-reduce, timed
    digests = {}
    for name, env in {"watched": {}, "unwatched": {"NO_WATCH": 1}}.items():
        out = tmp_path / name
        out.mkdir()
        p = torchrun(JOB, out, nproc=2, restarts=0, STEPS=6, PLAIN_DDP=1, **env)
        assert p.returncode == 0, f"{name}\n{p.stderr[-4000:]}"
        rs = ranks(out, 2)
        assert rs[0]["digest"] == rs[1]["digest"], name
        digests[name] = rs[0]["digest"]
        comms = [r["stats"]["training_comms"] for r in rs]
        assert all(c >= 5 for c in comms) if name == "watched" else comms == [0, 0], (name, comms)
    assert digests["watched"] == digests["unwatched"]


def ironweave_bin():
    exe = os.environ.get("IRONWEAVE_BIN") or str(
        Path(os.environ.get("CARGO_TARGET_DIR", HERE.parents[2] / "target")) / "release" / "ironweave"
    )
    if not Path(exe).is_file():
        pytest.skip(f"no ironweave binary at {exe}: build it (cargo build --release -p ironweave-cli) or set IRONWEAVE_BIN")
    return exe


def test_the_same_job_under_ironweave_launch_restart_all_ends_in_the_same_state(tmp_path, clean_run):
    # rank 1 SIGKILLs itself after step 13's backward and its kept copies are gone when it
    # comes back: `ironweave launch --restart-all` stops the others and restarts all four as
    # generation 1; rank 1 restores from its peer, the others from their kept copies
    before = shm_dirs()
    e = dict(os.environ, OUT=str(tmp_path), STEPS="20", FAIL_RANK="1", FAIL_STEP="13", FAIL_HOST="1")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
              "IRONWEAVE_RANK", "IRONWEAVE_KEEP_DIR", "IRONWEAVE_JOB_ID", "IRONWEAVE_MASTER_PORT", "IRONWEAVE_GENERATION"):
        e.pop(k, None)
    cmd = [ironweave_bin(), "launch", "-n", "4", "--max-restarts", "2", "--restart-all", "--", sys.executable, str(JOB)]
    p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    assert "restarting it as generation 1" in p.stderr
    rs = ranks(tmp_path)
    assert [r["digest"] for r in rs] == [clean_run[0]["digest"]] * 4, "the final state differs from the clean run's"
    assert all(r["attempt"] == 1 and r["seen"] == 20 for r in rs)
    got = [r["restored"] for r in rs]
    assert len({g["step"] for g in got}) == 1, got
    assert got[1]["source"] == "peer" and [got[r]["source"] for r in (0, 2, 3)] == ["own memory"] * 3, got
    assert shm_dirs() == before


MISMATCH = """
import json, os, torch
from ironweave.torch import Checkpointer
rank = int(os.environ["RANK"])
state = {"w": torch.zeros(4 if rank == 0 else 5), "b": torch.zeros(2)}
try:
    Checkpointer(state, timeout_s=30)
    outcome = "accepted"
except Exception as e:
    outcome = type(e).__name__ + ": " + str(e)
open(os.path.join(os.environ["OUT"], f"rank-{rank}.json"), "w").write(json.dumps({"outcome": outcome}))
"""


def test_ranks_with_different_states_are_refused_on_every_rank_naming_the_key(tmp_path):
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    p = torchrun(script, tmp_path, nproc=2, restarts=0)
    assert p.returncode == 0, p.stderr[-4000:]
    outs = [r["outcome"] for r in ranks(tmp_path, 2)]
    for o in outs:
        assert o.startswith("StateMismatchError") and "`w`" in o and "rank 1" in o, o


@pytest.fixture
def world_of_one(monkeypatch, tmp_path):
    """A job of one rank in this process, its kept copies under tmp_path."""

    def fresh():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for k, v in {"IRONWEAVE_RANK": "0", "IRONWEAVE_WORLD_SIZE": "1", "IRONWEAVE_MASTER_ADDR": "127.0.0.1",
                     "IRONWEAVE_MASTER_PORT": str(port), "IRONWEAVE_KEEP_DIR": str(tmp_path / "keep"),
                     "IRONWEAVE_JOB_ID": "pytest"}.items():
            monkeypatch.setenv(k, v)

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    fresh()
    return fresh


def small_state(n=4):
    model = torch.nn.Linear(n, 2)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.1), "epoch": 0}


def test_a_restore_brings_back_tensors_of_every_dtype_and_the_picklable_values(world_of_one):
    bf = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = base.t()  # not contiguous
    state = dict(small_state(), bf=bf, view=view, flags=torch.tensor([True, False]), note={"k": [1, 2]})
    ck = Checkpointer(state)
    assert ck.restore() is None  # nothing anywhere: a fresh start
    ck.save(1)
    ck.save(2)
    keep = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items() if k in ("bf", "flags")}
    ck.close(remove_kept=False)
    with torch.no_grad():
        bf.zero_()
        base.zero_()
        state["flags"].fill_(False)
    state["note"] = None
    world_of_one()
    ck = Checkpointer(state)
    info = ck.restore()
    assert info["step"] == 2 and info["source"] == "own memory"
    assert torch.equal(bf, keep["bf"]) and torch.equal(state["flags"], keep["flags"])
    assert torch.equal(base, torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert state["note"] == {"k": [1, 2]}
    ck.close()
    # the engine's copies under the job's directory are gone
    assert not (Path(os.environ["IRONWEAVE_KEEP_DIR"]) / "checkpointer-0").exists()


def test_bad_input_gives_the_typed_error_and_restores_nothing(world_of_one):
    # a tensor that is not on the CPU (a meta tensor stands in for CUDA in a build without GPU)
    with pytest.raises(ironweave.ConfigurationError, match="meta"):
        Checkpointer({"w": torch.empty(3, device="meta")})
    # picklable values larger than their room
    with pytest.raises(ironweave.ConfigurationError, match="extras_bytes"):
        Checkpointer({"w": torch.zeros(2), "blob": b"x" * 5000}, extras_bytes=1024)
    world_of_one()
    state = small_state()
    ck = Checkpointer(state)
    ck.save(3)
    with pytest.raises(ironweave.ConfigurationError, match="steps must increase"):
        ck.save(3)
    ck.close(remove_kept=False)
    with pytest.raises(ironweave.ClosedError):
        ck.save(4)
    # the job comes back with another shape: the kept copies are named, nothing is restored
    world_of_one()
    changed = small_state(5)
    before = changed["model"].weight.detach().clone()
    ck = Checkpointer(changed)
    with pytest.raises(ironweave.StateMismatchError, match="model.weight"):
        ck.restore()
    assert torch.equal(changed["model"].weight, before)
    ck.close()


def test_the_example_runs_under_torchrun_as_docs_pytorch_shows_it(tmp_path):
    root = HERE.parents[2]
    example = root / "examples" / "python" / "train_ddp.py"
    code = example.read_text().split('"""', 2)[2].strip()
    assert code in (root / "docs" / "PYTORCH.md").read_text(), "docs/PYTORCH.md's script differs from the example"
    p = torchrun(example, tmp_path, restarts=0, STEPS=12)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "step 10 loss" in p.stdout and "committed 9" in p.stdout, p.stdout[-2000:]


def test_a_keep_directory_without_room_is_refused_before_training(world_of_one, monkeypatch, tmp_path):
    """The kept copies on a tmpfs of 64 KiB (a container's /dev/shm is 64 MB by default), a
    state of 256 KiB: the checkpointer refuses at construction — before any step is trained —
    naming the directory, the bytes needed and the fixes; a state that fits is accepted."""
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tiny)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()}): needs root")
    try:
        monkeypatch.setenv("IRONWEAVE_KEEP_DIR", str(tiny / "keep"))
        with pytest.raises(ironweave.ConfigurationError) as e:
            Checkpointer({"w": torch.ones(64 * 1024)}, timeout_s=30)
        msg = str(e.value)
        assert isinstance(e.value, ValueError)
        assert str(tiny) in msg and "MB" in msg and "--shm-size" in msg and "keep_dir=" in msg, msg
        world_of_one()
        ck = Checkpointer({"w": torch.ones(256)}, timeout_s=30)  # 1 KiB: 6 KiB at the peak
        ck.save(1)
        ck.close()
    finally:
        subprocess.run(["umount", str(tiny)], capture_output=True)


def test_finish_destroys_the_group_flushes_and_exits_with_the_code_it_is_given():
    # finish() leaves through os._exit (no interpreter finalization, where torch 2.15's gloo
    # threads can abort the process): the output written without a newline must still arrive
    # (flushed), the group must be gone before the exit, and the code must be the one asked for
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = (
        "import sys, torch.distributed as dist\n"
        "from ironweave.torch import finish\n"
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=0, world_size=1)\n"
        "real = dist.destroy_process_group\n"
        "def spy(*a, **k):\n"
        "    real(*a, **k)\n"
        "    print('destroyed ' + str(dist.is_initialized()), end=' ')\n"
        "dist.destroy_process_group = spy\n"
        "print('done', end=' ')\n"
        "sys.stderr.write('err')\n"
        "finish(3)\n"
        "print('after')\n"
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stderr
    assert p.stdout == "done destroyed False ", p.stdout
    assert p.stderr.endswith("err"), p.stderr
