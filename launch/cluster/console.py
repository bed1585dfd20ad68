"""What the supervisor of launch.train prints: the job's console.

Every worker writes to one pipe (stdout and stderr); ``Console.line`` gets each
line with its host and decides what a user sees. By default: host 0's lines
of this project at INFO (the progress line every ``--log_every`` steps, the
recovery with its tier, seconds and bytes, the timeline), warnings of this
project from every host, errors from every host, and lines that are not log
records (prints). Hidden unless ``--verbose``: INFO of other hosts and of the
libraries (absl INFO of jax.distributed, orbax), warnings of the libraries
(JAX, orbax), gloo's connection lines, C++ log lines.

A traceback is held back until its process ends. If the launcher itself killed
a peer in this attempt (an injected fault), the traceback is the expected
consequence and the console prints one line instead: ``host N stopped after
host K was killed``; every other traceback is printed in full. After an
injected kill the surviving hosts' error chatter (gloo, the coordination
service: errors, lines that are not log records) is dropped for the same
reason; their progress and warnings still show.

Design choice: classify the lines in the supervisor, where the fault injector
knows which failures it caused. Alternative not taken: quieting each worker's
loggers, which cannot reach gloo's or XLA's C++ output and cannot know that a
failure was injected.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path

# An absl-formatted log record: level, date, time, thread, file:line] message.
_ABSL = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ ([^:\]\s]+):\d+\] ?(.*)$")
# A Python warning's first line ("path.py:12: UserWarning: ...").
_PY_WARNING = re.compile(r"^\S+\.py:\d+: \w*Warning\b")
# Library chatter that is not an absl record.
_CHATTER = (re.compile(r"\[Gloo\]"),
            re.compile(r"^WARNING: All log messages before absl::InitializeLog"))
# gloo's connection line; it comes from several threads at once and may reach
# the pipe split anywhere, so any piece of it (numbers generalized) is chatter,
# down to a lone rank number ("0") cut off between two threads' writes.
_GLOO_CONNECTED = ("[Gloo] Rank 0 is connected to 0 peer ranks. "
                   "Expected number of connected peer ranks is : 0")


def _gloo_piece(text: str) -> bool:
    """Whether ``text`` is a piece (one character or more) of gloo's connection line."""
    piece = re.sub(r"\d+", "0", text.strip())
    return len(piece) >= 1 and piece in _GLOO_CONNECTED
_TRACEBACK = "Traceback (most recent call last):"
# jax.distributed's coordination service, when a host missed its heartbeats
# (--peer_timeout_s): the silent hosts' indices follow, one per line.
_SILENT = "stopped sending heartbeats"
_LEVELS = {"W": "WARNING: ", "E": "ERROR: ", "F": "FATAL: "}


def _project_files() -> frozenset[str]:
    """Base names of this project's Python modules (launch/, models/, capricorn_jax/)."""
    root = Path(__file__).resolve().parents[2]
    return frozenset(p.name for d in ("launch", "models", "capricorn_jax")
                     for p in (root / d).rglob("*.py"))


class Console:
    """Filters and prints the lines of a simulated cluster's hosts.

    Args:
      verbose: print every line as it comes (``[host i] line``).
      write: where the lines go (default: this process's stdout).
    """

    def __init__(self, verbose: bool = False,
                 write: Callable[[str], None] | None = None) -> None:
        self.verbose = verbose
        self._write = write or self._stdout
        self._lock = threading.Lock()
        self._ours = _project_files()
        self.killed: tuple[int, ...] = ()  # the hosts the launcher killed in this attempt
        self._fault = "killed"  # or "paused" (SIGSTOP)
        self._held: dict[int, list[str]] = {}
        self._warning_source: set[int] = set()
        self._silent_list: set[int] = set()  # hosts whose next lines list silent hosts
        self.silent: set[int] = set()  # hosts reported silent in this attempt

    @staticmethod
    def _stdout(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def attempt(self) -> None:
        """A new attempt of the job starts: no host killed, nothing held."""
        with self._lock:
            self.killed, self._held, self._warning_source = (), {}, set()
            self._fault = "killed"
            self._silent_list, self.silent = set(), set()

    def injected_kill(self, hosts: tuple[int, ...], what: str = "killed") -> None:
        """The launcher is about to kill (or pause: ``what``) ``hosts``: the
        others' failures follow from it."""
        with self._lock:
            self.killed, self._fault = tuple(hosts), what

    def say(self, text: str) -> None:
        """A line of the supervisor itself."""
        with self._lock:
            self._write(text.rstrip("\n") + "\n")

    def _emit(self, host: int, text: str) -> None:
        self._write(f"[host {host}] {text}\n")

    def line(self, host: int, raw: str) -> None:
        """One line host ``host`` printed (a ``LocalCluster`` ``on_line``)."""
        text = raw.rstrip("\n")
        with self._lock:
            self._heartbeats(host, text)
            if self.verbose:
                self._emit(host, text)
                return
            if host in self._held:
                self._held[host].append(text)
                return
            if not text.strip():
                return  # an empty line says nothing (a library's, or a split write)
            if text.startswith(_TRACEBACK):
                self._held[host] = [text]
                return
            shown = self._shown(host, text)
            if shown is not None and (not self.killed or host in self.killed
                                      or _ABSL.match(text) and text[0] in "IW"):
                self._emit(host, shown)

    def _heartbeats(self, host: int, text: str) -> None:
        """One ``fault:`` line per host that jax.distributed declared silent
        (no heartbeat within ``--peer_timeout_s``), whichever host reports it."""
        if _SILENT in text:
            self._silent_list.add(host)
            return
        if host not in self._silent_list:
            return
        if not text.strip().isdigit():
            self._silent_list.discard(host)
            return
        silent = int(text.strip())
        if silent not in self.silent and (silent not in self.killed or self._fault != "killed"):
            self.silent.add(silent)
            self._write(f"fault: host {silent} sent no heartbeat within --peer_timeout_s "
                        f"(paused, hung or cut off); the job stops\n")

    def _shown(self, host: int, text: str) -> str | None:
        """What the console prints of a line outside a traceback, or None."""
        if host in self._warning_source:  # the source line under a Python warning
            self._warning_source.discard(host)
            if text.startswith(" "):
                return None
        record = _ABSL.match(text)
        if record is None:
            if _PY_WARNING.match(text):
                self._warning_source.add(host)
                return None
            chatter = any(c.search(text) for c in _CHATTER) or _gloo_piece(text)
            return None if chatter else text
        level, source, message = record.groups()
        ours = source in self._ours
        if level == "I":
            return message if ours and host == 0 else None
        if level == "W" and not ours:
            return None
        if level == "E" and message == "worker failed":  # the traceback follows
            self._held[host] = [text]
            return None
        return _LEVELS[level] + message

    def ended(self, host: int) -> None:
        """Host ``host``'s output ended (its process exited): a held traceback
        is printed in full, or, after an injected kill of a peer, one line."""
        with self._lock:
            held = self._held.pop(host, None)
            if self.verbose:
                return
            if self.killed and host not in self.killed:
                victims = " and ".join(str(h) for h in self.killed)
                self._emit(host, f"stopped after host {victims} was {self._fault} "
                                 f"(its error output: --verbose)")
            elif held:
                for text in held:
                    self._emit(host, text)
