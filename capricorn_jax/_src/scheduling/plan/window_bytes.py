"""Where a window's bytes went on the threaded path: sent inside it, or late.

``window_bytes`` splits each window's frames at its closing mark (pure, from
the sender's frame log, the marks' times and the queue they sampled) into
``WindowBytes``. It is separate from the sender because it is a pure
accounting of what the sender recorded: the long-run records and their
property tests use it without threads, sockets or marks.
"""

from __future__ import annotations

import dataclasses

from capricorn_jax._src.scheduling.plan.sites import Site


@dataclasses.dataclass(frozen=True)
class WindowBytes:
    """Where a window's bytes went, on this host's link to its peer.

    Attributes:
      planned: the window's chunk bytes (all its rows), as the schedule put them.
      sent: bytes handed to the kernel in the window before its closing mark
        and no longer queued then (on their way or across: they did not meet
        the collective that mark starts).
      late: the rest of the bytes handed over in the window: after the
        closing mark, or still queued (unacknowledged) at it, i.e. bytes
        that met the collective.
      carried_out: planned bytes the deadline sender moved on to a later
        window (or after the step); carried_in: earlier windows' bytes sent
        in this one. sent + late = planned - carried_out + carried_in.
    """

    planned: int
    sent: int
    late: int
    carried_out: int = 0
    carried_in: int = 0


def window_bytes(frames: list[tuple[Site, float, float, int, Site]],
                 window_sites: dict[int, tuple[Site, Site]],
                 opened: dict[Site, float],
                 queued_at: dict[Site, int | None],
                 planned: dict[int, int] | None = None,
                 closes_at: dict[int, tuple[float, int | None]] | None = None
                 ) -> dict[int, WindowBytes]:
    """Per window (index -> WindowBytes) of one step, from its frames (pure).

    Args:
      frames: (the site a frame was sent in, when its send began, when it
        ended, its bytes, the site whose window planned it), every frame of
        the step.
      window_sites: window index -> (opening site, closing site).
      opened: site -> when its mark opened it (windows whose closing site
        never opened count every byte as sent).
      queued_at: site -> the channel's unacknowledged bytes when it opened
        (None or absent: unknown, counted as 0).
      planned: window index -> its bytes in the schedule (default: the bytes
        it planned that frames carried).
      closes_at: window index -> (when it closed, the bytes unacknowledged
        then) where that is known better than its closing site's mark: the
        start of the first collective after it opened (the closing site
        is the next window's opening, after that collective ended, when a
        first-in-first-out link has drained what met it).

    A frame whose send spans the closing mark is split in proportion to the
    time on either side (a send's bytes leave at the link's rate). The bytes
    queued at the closing mark are the last ones handed over (the queue is
    first in, first out), so they count against this window's bytes handed
    over before the mark, at most all of them (the rest were an earlier
    window's). Alternative not taken: per-packet timestamps
    (``SO_TIMESTAMPING``), finer but a kernel feature per platform.
    """
    out = {}
    for i, (open_, close) in window_sites.items():
        mine = [(t0, t1, n) for site, t0, t1, n, _ in frames if site == open_]
        carried_in = sum(n for site, _, _, n, origin in frames if site == open_ != origin)
        carried_out = sum(n for site, _, _, n, origin in frames if origin == open_ != site)
        handed_total = sum(n for _, _, n in mine)
        wanted = (handed_total - carried_in + carried_out if planned is None
                  else planned.get(i, 0))
        t_close, queued_close = opened.get(close), queued_at.get(close)
        if closes_at is not None and i in closes_at:
            t_close, queued_close = closes_at[i]
        if t_close is None:
            out[i] = WindowBytes(wanted, handed_total, 0, carried_out, carried_in)
            continue
        before = 0.0
        for t0, t1, n in mine:
            if t1 <= t_close:
                before += n
            elif t0 < t_close:
                before += n * (t_close - t0) / (t1 - t0)
        handed = int(round(before))
        queued = min(handed, max(0, queued_close or 0))
        out[i] = WindowBytes(wanted, handed - queued, handed_total - handed + queued,
                             carried_out, carried_in)
    return out
