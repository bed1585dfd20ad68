"""What a keyed MAC per chunk channel frame would cost: CPU seconds per MB.

    python -m launch.experiments.frame_mac_cost --mib=256 --repeats=5

One thread, one core: the CPU time (``time.process_time``) of HMAC-SHA256
and keyed BLAKE2b over ``--mib`` MiB cut into frames of 64 KiB (the
deadline sender's piece) and of 1 MiB (the chunk cap), each the fastest of
``--repeats``, beside zlib's CRC32 (a checksum pass of the kind every frame
already has, for scale). Prints milliseconds of CPU per MB (10^6 bytes)
and the implied single-core throughput; ``--json`` writes them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import zlib
from collections.abc import Callable

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = FLAGS) -> flags.FlagValues:
    """Its flags, defined when run as a command (nothing at import)."""
    from launch import cli_flags

    cli_flags.define(fv, {"output": ("json",)})
    flags.adopt_module_key_flags(cli_flags, flag_values=fv)
    flags.DEFINE_integer("mib", 256, "MiB digested per measurement.", flag_values=fv)
    flags.DEFINE_integer("repeats", 5,
                         "Measurements per digest and frame size (the fastest kept).",
                         flag_values=fv)
    return fv


_KEY = b"k" * 32


def _hmac_sha256(frame: memoryview) -> None:
    hmac.new(_KEY, frame, hashlib.sha256).digest()


def _blake2b(frame: memoryview) -> None:
    hashlib.blake2b(frame, key=_KEY, digest_size=32).digest()


def _crc32(frame: memoryview) -> None:
    zlib.crc32(frame)


def _cost(digest: Callable[[memoryview], None], data: bytes, frame: int, repeats: int) -> float:
    """CPU seconds per byte of ``digest`` over ``data`` in frames of ``frame`` bytes."""
    view = memoryview(data)
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for lo in range(0, len(view), frame):
            digest(view[lo:lo + frame])
        best = min(best, time.process_time() - start)
    return best / len(data)


def main(argv: list[str]) -> None:
    del argv
    data = bytes(range(256)) * (FLAGS.mib << 12)
    results = {}
    for name, digest in (("hmac_sha256", _hmac_sha256), ("blake2b_keyed", _blake2b),
                         ("crc32_zlib", _crc32)):
        for frame in (64 << 10, 1 << 20):
            per_byte = _cost(digest, data, frame, FLAGS.repeats)
            key = f"{name}/{frame >> 10}KiB"
            results[key] = {"cpu_ms_per_mb": round(per_byte * 1e9, 3),
                            "mb_per_cpu_s": round(1 / per_byte / 1e6, 1)}
            print(f"{key:24s} {per_byte * 1e9:7.3f} ms CPU per MB  "
                  f"({1 / per_byte / 1e6:7.1f} MB/s on one core)", flush=True)
    if FLAGS.json:
        with open(FLAGS.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    define_flags()
    app.run(main)
