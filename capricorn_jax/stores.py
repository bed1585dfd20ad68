"""Lists the jobs' RAM stores on this host, and prunes the ones no job uses.

    python -m capricorn_jax.stores                                   # list
    python -m capricorn_jax.stores --action=prune --job=NAME          # one job
    python -m capricorn_jax.stores --action=prune --older_than_h=24   # unused for a day
    python -m capricorn_jax.stores --action=prune --all               # every job not in use

``list`` prints one line per job under ``--store_root`` (hosts, versions per
host, bytes, last use, "in use" while a process holds one of its stores),
then the total and the RAM disk's size and free space. ``prune`` deletes the
jobs matched, one line each with the bytes freed; a job in use is skipped
(one line), and so is a job that may restart from its stores (its newest
in-memory version is newer than its newest persistent step), saying why,
unless ``--force``; it exits 1 when a job named with ``--job`` does not exist. It
ships with the library (the store's errors point here); the functions are
re-exported: ``list_jobs``, ``listing``, ``prune``, ``default_store_root``,
``record_persistent`` and ``newest_persistent_step``.
"""


from __future__ import annotations

import sys

from absl import app, flags

from capricorn_jax._src.memory.store import store_admin


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> flags.FlagValues:
    """Its absl flags, defined when run as a command (or by a test on a fresh
    ``fv``): nothing is defined at import."""
    flags.DEFINE_string("store_root", store_admin.default_store_root(),
                        "Base directory of the host RAM stores (tmpfs).",
                        flag_values=fv)
    flags.DEFINE_enum("action", "list", ["list", "prune"],
                      "list the jobs' stores, or prune them.", flag_values=fv)
    flags.DEFINE_string("job", None,
                        "prune: the job to delete (its directory under --store_root).",
                        flag_values=fv)
    flags.DEFINE_float("older_than_h", None,
                       "prune: delete the jobs whose newest file is older than this many hours.",
                       flag_values=fv)
    flags.DEFINE_boolean("all", False, "prune: delete every job not in use.", flag_values=fv)
    flags.DEFINE_boolean("force", False,
                         "prune: also delete jobs that may restart from their stores (newest "
                         "in-memory version newer than the newest persistent step).",
                         flag_values=fv)
    return fv


FLAGS = flags.FLAGS

list_jobs = store_admin.list_jobs
listing = store_admin.listing
prune = store_admin.prune
default_store_root = store_admin.default_store_root
JobStores = store_admin.JobStores
ram_disk = store_admin.ram_disk
record_persistent = store_admin.record_persistent
newest_persistent_step = store_admin.newest_persistent_step


def run(store_root: str, action: str, job: str | None, older_than_h: float | None,
        everything: bool, out=sys.stdout, force: bool = False) -> int:
    """The command; its exit code (0 done, 1 a named job is missing, 2 bad flags)."""
    if action == "list":
        if job is not None or older_than_h is not None or everything or force:
            print("stores: error: --job, --older_than_h, --all and --force are for "
                  "--action=prune",
                  file=sys.stderr)
            return 2
        for line in store_admin.listing(store_root):
            print(line, file=out)
        return 0
    try:
        result = store_admin.prune(store_root, jobs=[job] if job is not None else [],
                                   older_than_h=older_than_h, everything=everything,
                                   force=force)
    except ValueError as e:
        print(f"stores: error: {e} (--job, --older_than_h or --all)", file=sys.stderr)
        return 2
    for name in result.in_use:
        print(f"prune: skipped {name}: in use (a process holds its store open)", file=out)
    for name, why in result.kept:
        print(f"prune: kept {name}: {why}; --force deletes it", file=out)
    for name, size in result.deleted:
        print(f"prune: deleted {name} ({store_admin.mib(size)}, {size} bytes freed)", file=out)
    for name in result.missing:
        print(f"prune: no job {name!r} under {store_root}", file=out)
    if not (result.in_use or result.deleted or result.missing or result.kept):
        print(f"prune: nothing matched under {store_root}", file=out)
    return 1 if result.missing else 0


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        print(f"stores: error: unexpected arguments {argv[1:]}", file=sys.stderr)
        sys.exit(2)
    sys.exit(run(FLAGS.store_root, FLAGS.action, FLAGS.job, FLAGS.older_than_h, FLAGS.all,
                 force=FLAGS.force))


if __name__ == "__main__":
    define_flags()
    app.run(main)
