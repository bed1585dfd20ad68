"""Sockets whose descriptors native code uses by number, released only once unused.

The chunk channel's native loops (``native.frames``) take a socket's
descriptor number, and a receive may wait between two of them (for its
version's buffer). A number closed while such a loop still holds it goes
to the next socket the process opens (the kernel hands out the lowest free
number): a new channel's connection, whose hello the stale loop then reads
or writes, so that hello fails ("not a chunk channel hello") on both hosts.
So ``close`` shuts the sockets down at once (a loop blocked on one wakes
with an error, and any later call on the number fails) and closes them,
releasing the numbers, only once the last send or receive under way left.

Alternative not taken: the native loops holding a reference of their own
(``dup``); every call would cost two more system calls, and a loop that
outlived its channel would still send on the old connection.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class HeldSockets:
    """``sockets`` shared by the threads that send and receive on them
    (``name``: what an error says is closed)."""

    def __init__(self, name: str, *sockets: socket.socket) -> None:
        self.name, self.sockets = name, sockets
        self.closed = False
        self._lock = threading.Lock()
        self._users = 0
        self._released = False

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """The sockets' descriptors stay theirs until this ends.

        Raises:
          ConnectionError: ``close`` was called.
        """
        with self._lock:
            if self.closed:
                raise ConnectionError(f"{self.name} is closed")
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                last = self._users == 0 and self.closed
            if last:
                self._release()

    def close(self) -> None:
        """Shuts the sockets down now (a thread blocked on one wakes with an
        error); closes them now, or when the last holder leaves."""
        with self._lock:
            self.closed = True
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            idle = self._users == 0
        if idle:
            self._release()

    def _release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        for s in self.sockets:
            try:
                s.close()
            except OSError:
                pass
