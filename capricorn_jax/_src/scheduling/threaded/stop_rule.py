"""The deadline sender's stop rule, one decision before each frame, pure.

Before each frame of a window the sender (``ThreadedSender._send_until`` in
Python, ``CapricornSendWindow`` in ``native/frames.cc``) decides, in this
order: stop if a collective began after the window opened (``STARTED``);
stop if the link could not carry the frame by the window's planned close,
now + (bytes ahead on the link + the frame) / rate > close (``CLOSE``);
send if at most ``queue_bound`` bytes are ahead (``SEND``); wait otherwise
(``WAIT``). The bytes ahead are a model (what was handed over, drained at
the link's rate since) capped by what the kernel holds unacknowledged, when
it says.

Design choice: the rule a pure function of its inputs in each language, so
a test runs the Python and the native one side by side on the same inputs
(``tests/test_stop_rule.py``). Alternative not taken: comparing the two
loops on live sockets only, where timing decides which branch a test meets.
"""

from __future__ import annotations

SEND, STARTED, CLOSE, WAIT = range(4)
"""The decisions (``frames.cc``'s ``Decision``, same values)."""


def ahead(now: float, link: tuple[float, float], kernel: float | None, rate: float) -> float:
    """Bytes still ahead on the link at ``now`` (seconds): ``link`` (bytes
    handed over, when) drained at ``rate``, at most ``kernel`` (the kernel's
    unacknowledged bytes, ``SIOCOUTQ``; None: unknown). Why both: on a
    first-in-first-out link the peer's acknowledgements queue behind the
    peer's own chunk bytes, so the kernel's count stays high for that long
    after the bytes left (waiting for it starved the windows: 38 of 205 KB
    sent in one); the model alone would miss a link slower than measured."""
    queued, since = link
    model = max(0.0, queued - rate * (now - since))
    return model if kernel is None else min(model, float(kernel))


def decide(started: bool, now: float, link: tuple[float, float], kernel: float | None,
           nbytes: float, rate: float, close: float, queue_bound: float) -> tuple[int, float]:
    """(the decision before a frame of ``nbytes``, the bytes ahead); times in
    seconds, ``rate`` in bytes per second (> 0)."""
    if started:
        return STARTED, 0.0
    queued = ahead(now, link, kernel, rate)
    if now + (queued + nbytes) / rate > close:
        return CLOSE, queued
    if queued <= queue_bound:
        return SEND, queued
    return WAIT, queued
