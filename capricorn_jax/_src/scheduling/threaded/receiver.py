"""The threaded path's receive loop: the peer's frames into their versions' buffers.

One thread per chunk channel (``ThreadedSender`` starts it, and a new one on
``reconnect``) reads the peer's frames, runs of them in native code off the
GIL where that was built (``ChunkChannel.receive_frames``), a frame at a time
in Python otherwise, into the buffer of the version each names
(``Versions.buffer``), and counts them (``Versions.received``). A corrupt
frame (checked end to end) drops its version and the channel goes on; any
other failure fails every version in flight whose bytes have not all
arrived and ends the loop, unless the
channel is no longer the sender's (closed, or replaced by ``reconnect``),
when the loop ends without a trace.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from capricorn_jax._src.scheduling.threaded.chunk_channel import ChunkChannel, CorruptFrame
from capricorn_jax._src.scheduling.threaded.versions import Versions

log = logging.getLogger(__name__)


def receive_loop(channel: ChunkChannel, versions: Versions, timeout_s: float, native: bool,
                 live: Callable[[], bool], failed: Callable[[BaseException], None]) -> None:
    """Receives on ``channel`` while ``live()`` (the sender is open and
    ``channel`` still its own). ``timeout_s``: how long a frame of a version
    this host has not started waits for it (``Versions.buffer``); ``native``:
    runs of frames in native code; ``failed``: told the error that ended
    the channel (every version in flight fails with it)."""
    buffer = functools.partial(versions.buffer, timeout_s=timeout_s, host=channel.host,
                               source=channel.source)
    while live():
        try:
            # Idle between steps is not a failure: no frame within the
            # channel's bound is waited for again (the socket keeps its
            # timeout, so a frame costs no timeout changes).
            if native:  # a run of frames per call, off the GIL
                frames = channel.receive_frames(buffer, versions.remaining, idle_ok=True)
            else:
                one = channel.receive_into(buffer, idle_ok=True)
                frames = None if one is None else [one]
            if frames is None:
                continue
        except CorruptFrame as e:
            # Checked end to end: the version is dropped (its wait raises,
            # so no holder commits it; the caller's warning says so), the
            # channel goes on.
            log.info("%s; version %d dropped", e, e.version)
            bad = versions.get(e.version)
            if bad is not None:
                bad.fail(e)
            continue
        except BaseException as e:  # noqa: BLE001
            if not live():
                return
            failed(e)
            versions.fail_incomplete(e)  # a version that arrived whole keeps its bytes
            return
        versions.received(frames, channel.host)
