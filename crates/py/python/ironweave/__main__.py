"""``python -m ironweave clean``: lists this user's kept copies in ``/dev/shm`` and removes the
orphans — copies whose every launcher (the torchrun agent, ``ironweave launch``) has ended, so
no process of their job can restart and restore from them (a job out of restarts, a killed
agent). Copies of a job whose launcher still runs are listed and kept. Another user's
directories are neither listed nor touched.

    python -m ironweave clean            # remove the orphans, list the rest
    python -m ironweave clean --dry-run  # list only
    python -m ironweave clean --base DIR # another shared-memory directory

Which copies are orphans is the library's decision (``ironweave::checkpointer::kept_jobs``);
this command prints and removes.
"""

from __future__ import annotations

import argparse
import shutil
import sys

from ironweave import _native


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def clean(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ironweave clean", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="list only, remove nothing")
    ap.add_argument("--base", default="/dev/shm", help="the shared-memory directory (default /dev/shm)")
    a = ap.parse_args(argv)
    jobs = _native.kept_jobs(a.base)
    if not jobs:
        print(f"no kept copies of this user under {a.base}")
        return 0
    freed = 0
    status = 0
    for d, nbytes, launchers, orphan in jobs:
        alive = [l for l, up in launchers if up]
        if not orphan:
            print(f"kept     {d}  {_mb(nbytes)}  (launcher {', '.join(alive)} still runs)")
            continue
        if a.dry_run:
            print(f"orphan   {d}  {_mb(nbytes)}  (no launcher runs: would be removed)")
            continue
        try:
            shutil.rmtree(d)
            freed += nbytes
            print(f"removed  {d}  {_mb(nbytes)}")
        except OSError as e:
            print(f"failed   {d}: {e}", file=sys.stderr)
            status = 1
    if not a.dry_run:
        print(f"freed {_mb(freed)}")
    return status


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "clean":
        print("usage: python -m ironweave clean [--dry-run] [--base DIR]", file=sys.stderr)
        return 2
    return clean(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
