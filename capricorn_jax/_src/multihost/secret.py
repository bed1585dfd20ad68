"""The job's secret: what a chunk channel peer proves it knows.

A random per-job key (32 random bytes, written as 64 hex digits), never
derived from a path or a name: whoever can read the job's workdir name or
the key-value store learns nothing of it. It comes, first match wins, from:

1. ``CAPRICORN_CHANNEL_SECRET``: the secret itself (at least 16 bytes), for
   clusters that hand every process its secrets through the environment;
2. ``CAPRICORN_CHANNEL_SECRET_FILE``: a file holding it, made by the user
   or the cluster (read, never created);
3. the program's file (``InMemoryOptions.channel_secret_file``; the
   launchers: ``WORKDIR/.capricorn.secret``), read, or created when absent.

The environment wins over the program's file, so a cluster that
distributes secrets reaches every process whatever the program passes.

A secret file must be the user's alone: it is created with mode 0600, and
one that the group or others may read, write or run is refused on read,
naming its mode and the ``chmod`` that fixes it (checked on the opened
file, so a symlink, e.g. a cluster's mounted secret, is judged by its
target). A new file is written under a temporary name and linked into place,
so a reader never sees half a secret, and of several hosts creating one on
a shared workdir at once the first link wins and the others read its secret.

Design choice: a file in the workdir (made by the supervisor before it
starts the hosts, or by the first host) and the environment. Alternatives
not taken: the secret through the jax.distributed key-value store (anyone
who reaches the coordinator's port reads it; the store is not
authenticated); a secret derived from the job's name or workdir (anyone who
knows the path computes it, as the old job token).
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

SECRET_ENV = "CAPRICORN_CHANNEL_SECRET"
"""The environment variable that holds the secret itself."""
SECRET_FILE_ENV = "CAPRICORN_CHANNEL_SECRET_FILE"
"""The environment variable that names the secret's file."""
SECRET_NAME = ".capricorn.secret"
"""The secret's file in a launcher's workdir."""
MIN_BYTES = 16
"""The shortest secret accepted (a user's own secret; a made one has 64 bytes of hex)."""
_MAX_BYTES = 4096


class SecretError(RuntimeError):
    """No usable secret: none given, or a file that is unsafe or unreadable."""


def read_secret(path: str | os.PathLike) -> bytes:
    """The secret in ``path`` (whitespace around it dropped).

    Raises:
      FileNotFoundError: there is no such file.
      SecretError: the group or others have any permission on it, or it is
        shorter than ``MIN_BYTES`` or longer than 4 KiB.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO would block)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SecretError(f"the chunk channel secret {path} is not a regular file")
        if info.st_mode & 0o077:
            raise SecretError(
                f"the chunk channel secret {path} has mode {stat.S_IMODE(info.st_mode):04o}: "
                f"others than its owner may read it; refused (chmod 600 {path})")
        data = os.read(fd, _MAX_BYTES + 1)
    finally:
        os.close(fd)
    key = data.strip()
    if not MIN_BYTES <= len(key) <= _MAX_BYTES:
        raise SecretError(f"the chunk channel secret {path} holds {len(key)} bytes; it needs "
                          f"{MIN_BYTES} to {_MAX_BYTES}")
    return key


def create_secret(path: str | os.PathLike, replace: bool = False) -> bytes:
    """Writes a new random secret to ``path`` (mode 0600) and returns it.

    ``replace``: a file already there is replaced (a job's start, under the
    workdir's lock); otherwise the file already there wins and its secret
    is returned (``read_secret``'s checks apply).
    """
    target = Path(path)
    key = secrets.token_hex(32).encode()
    fd, temporary = tempfile.mkstemp(prefix=".capricorn-secret-", dir=target.parent)
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, key + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(temporary, target)
            return key
        try:
            os.link(temporary, target)
        except FileExistsError:
            return read_secret(target)
        return key
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)


def load_or_create(path: str | os.PathLike) -> bytes:
    """The secret in ``path``, made first when there is none (``create_secret``)."""
    try:
        return read_secret(path)
    except FileNotFoundError:
        return create_secret(path)


def from_environment() -> bytes | None:
    """The secret the environment gives (``SECRET_ENV``, else the file named
    by ``SECRET_FILE_ENV``), or None when it gives none."""
    value = os.environ.get(SECRET_ENV)
    if value:
        key = value.strip().encode()
        if not MIN_BYTES <= len(key) <= _MAX_BYTES:
            raise SecretError(f"{SECRET_ENV} holds {len(key)} bytes; it needs {MIN_BYTES} to "
                              f"{_MAX_BYTES}")
        return key
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        try:
            return read_secret(path)
        except FileNotFoundError:
            raise SecretError(f"{SECRET_FILE_ENV}={path}: no such file") from None
    return None


def resolve_secret(path: str | os.PathLike | None) -> bytes:
    """The job's secret: the environment's, else ``path``'s (created when
    absent; module docstring).

    Raises:
      SecretError: neither gives one, or the one given is unsafe.
    """
    key = from_environment()
    if key is not None:
        return key
    if path is None:
        raise SecretError(
            f"the chunk channel needs the job's secret: set InMemoryOptions("
            f"channel_secret_file=...) to a file every host reads (created 0600 when absent), "
            f"or {SECRET_ENV} / {SECRET_FILE_ENV} on every host")
    return load_or_create(path)


def start_job_secret(directory: str | os.PathLike) -> dict[str, str]:
    """A launcher's start: unless the environment gives a secret, a new one
    in ``directory/.capricorn.secret`` (replacing an earlier job's), and the
    environment that names it to the hosts the launcher starts."""
    if os.environ.get(SECRET_ENV) or os.environ.get(SECRET_FILE_ENV):
        return {}
    path = Path(directory).absolute() / SECRET_NAME
    create_secret(path, replace=True)
    return {SECRET_FILE_ENV: str(path)}
