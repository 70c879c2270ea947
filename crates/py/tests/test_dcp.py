"""torch.distributed.checkpoint through ironweave's peer-memory storage, on real processes:
a 4-rank torchrun job saves with ``dcp.save`` and ``dcp.async_save`` and loads its copies back;
a 2-rank job loads the same copies onto its own layout (a DTensor's shards cut differently),
also after one holder's copies are deleted; and the storage's refusals of bad input.

Run by scripts/test.sh after the cargo tests (it builds and installs the wheel first)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ironweave
from ironweave.dcp import PeerMemoryReader, PeerMemoryWriter
from test_torch import torchrun, world_of_one  # noqa: F401  (a fixture)

JOB = Path(__file__).resolve().parent / "dcp_job.py"
KEYS = ["model", "optim", "dt", "bf16", "view", "mask", "extras"]


def reports(out, mode, n):
    return [json.loads((out / f"{mode}-{r}.json").read_text()) for r in range(n)]


def test_a_4_rank_checkpoint_round_trips_and_loads_onto_2_ranks_from_peers_copies(tmp_path):
    keep = Path("/dev/shm") / f"ironweave-pytest-dcp-{tmp_path.name}"
    shutil.rmtree(keep, ignore_errors=True)
    try:
        p = torchrun(JOB, tmp_path, nproc=4, restarts=0, MODE="save", KEEP=keep, STEPS=4)
        assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
        saved = reports(tmp_path, "save", 4)
        for r in saved:
            # the last step (saved with async_save) came back, every key equal: fp32, bf16, a
            # DTensor's shards, a non-contiguous view (loaded in place), a bool mask, values
            assert r["step"] == 4 and r["matched"] == {k: True for k in KEYS}, r
            assert r["view_contiguous"] is False
            st = r["stats"]
            # stats are read before close: step 4 is committed and kept by close
            assert st["saves"] == 4 and st["kept"] >= 3 and not st["failures"], st
            # every rank's items crossed to a peer each step
            assert st["replica_bytes_sent"] >= 4 * st["state_bytes"] > 0
        def load_on_two(name):
            out = tmp_path / name
            out.mkdir()
            shutil.copy(tmp_path / "ref.pt", out / "ref.pt")
            p = torchrun(JOB, out, nproc=2, restarts=0, MODE="load", KEEP=keep)
            assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
            for r in reports(out, "load", 2):
                assert r["step"] == 4 and r["dt_rows"] == 5 and r["matched"] == {k: True for k in KEYS}, r

        # a 2-rank job: each rank's 5 rows of the DTensor come from two of the 4 saved shards
        load_on_two("two")
        # rank 1's host is gone: its items come from the copy its peer kept
        shutil.rmtree(keep / "holder-00001")
        load_on_two("three")
    finally:
        shutil.rmtree(keep, ignore_errors=True)


def raised(e, kind):
    """The storage's own error inside DCP's CheckpointException (a BaseException that gathers every
    rank's error)."""
    errors = [f[0] for f in getattr(e.value, "failures", {}).values()] or [e.value]
    return all(isinstance(x, kind) for x in errors)


def test_the_storage_refuses_bad_input_with_typed_errors(world_of_one, tmp_path):  # noqa: F811
    import os

    keep = os.environ["IRONWEAVE_KEEP_DIR"]
    # a checkpoint id that is not a step
    w = PeerMemoryWriter(keep_dir=keep, timeout_s=30)
    with pytest.raises(ironweave.ConfigurationError, match="step"):
        w.reset("latest")
    # a dtype the storage does not keep, named
    with pytest.raises(BaseException, match="`z` is torch.complex64") as e:
        dcp.save({"z": torch.zeros(2, dtype=torch.complex64)}, storage_writer=w, checkpoint_id=1)
    assert raised(e, ironweave.ConfigurationError)
    world_of_one()
    w = PeerMemoryWriter(keep_dir=os.environ["IRONWEAVE_KEEP_DIR"], timeout_s=30)
    dcp.save({"a": torch.ones(3), "n": 1}, storage_writer=w, checkpoint_id=1)
    # the state changed between saves: refused, naming the item
    with pytest.raises(BaseException, match="`a`") as e:
        dcp.save({"a": torch.ones(4), "n": 1}, storage_writer=w, checkpoint_id=2)
    assert raised(e, ironweave.StateMismatchError)
    # a value that outgrew its room
    with pytest.raises(BaseException, match="bytes_capacity") as e:
        dcp.save({"a": torch.ones(3), "n": "x" * 5000}, storage_writer=w, checkpoint_id=3)
    assert raised(e, ironweave.ConfigurationError)
    dcp.save({"a": torch.full((3,), 7.0), "n": 2}, storage_writer=w, checkpoint_id=4)
    w.close(remove_kept=False)
    sd = {"a": torch.zeros(3), "n": 0}
    r = PeerMemoryReader(os.environ["IRONWEAVE_KEEP_DIR"])
    dcp.load(sd, storage_reader=r)
    assert r.step == 4 and torch.equal(sd["a"], torch.full((3,), 7.0)) and sd["n"] == 2
    # a directory with nothing in it
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ironweave.NothingToRestoreError, match="no iteration"):
        PeerMemoryReader(str(empty)).read_metadata()
    # through dcp.load, DCP turns it into its own error with the message
    with pytest.raises(BaseException, match="no iteration"):
        dcp.load({"a": torch.zeros(3)}, storage_reader=PeerMemoryReader(str(empty)))
    shutil.rmtree(os.environ["IRONWEAVE_KEEP_DIR"])
