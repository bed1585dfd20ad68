"""The seal of a store's commit record (head): a CRC32C over the record itself.

Why. A head names where a version's bytes are (owner, slot, each chunk's
offset, size and CRC32C) and which version they are (step, generation). The
chunks' CRC32Cs guard the bytes, and ``store._check_head`` checks every field
for type and range, but a field changed to another valid value (step 7
rewritten as 0 by RAM damage or a hand edit) passed both: the store listed
version 0 and served version 7's bytes for it (found by the head fuzz test).
The seal covers every field, so any change to a head makes it no version.

What. ``seal`` adds ``SEAL`` to a record (the CRC32C of its canonical JSON:
sorted keys, no spaces, the record as JSON reads it back); ``check_seal``
raises ValueError when a parsed record's seal is missing or differs.

Alternative not taken: a CRC of the head file's bytes in a second file; two
files cannot be renamed into place together, so a crash between the renames
would leave a good head with a stale seal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import crc32c as _crc32c

SEAL = "seal_crc32c"


def _body(record: dict[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in record.items() if k != SEAL}, sort_keys=True,
                      separators=(",", ":")).encode()


def seal(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as JSON reads it back, with its seal (what a head holds)."""
    canonical = json.loads(json.dumps(record))
    return {**canonical, SEAL: _crc32c.crc32c(_body(canonical))}


def check_seal(path: Path, record: Any) -> None:
    """Raises ValueError naming ``path`` unless ``record``'s seal matches it."""
    if not isinstance(record, dict):
        raise ValueError(f"{path}: a commit record that is not an object")
    found = record.get(SEAL)
    if type(found) is not int or found != _crc32c.crc32c(_body(record)):
        raise ValueError(f"{path}: the commit record does not match its seal "
                         f"({SEAL} {found!r}): damaged after it was written")
