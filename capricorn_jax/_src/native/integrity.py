"""The one integrity rule for checkpoint bytes in transit: its frame header and its checksum.

Rule: a version is committed on a host only when a CRC32C its sender
computed before the bytes left matches the receiver's over the bytes as
placed, with the frame headers inside the check, and the ranges received
are the schedule's (``Coverage``), not a byte count that adds up. Every path
calls this module: the chunk channel (``scheduling.threaded.chunk_channel``, Python
and ``native.frames``), the in-graph exchange of inmem/pec
(``memory.wire.transport``), the in-step sender of the GPU path
(``scheduling.in_graph.executor``) and recovery's serve round
(``memory.tier.recovery``).

The checksum is CRC32C (Castagnoli, reflected polynomial ``0x82F63B78``),
the store's checksum too, in three implementations held to one another by
the tests: ``crc32c`` here (the ``crc32c`` package: hardware-accelerated,
the GIL released), the native one (``NATIVE_SOURCE``: SSE4.2's ``crc32``
instruction where the CPU has it, slicing-by-8 tables otherwise) and
``crc32c_rows`` inside XLA programs. Why CRC32C in XLA rather than the
word sums it replaced (a sum of 32-bit words and a position-weighted sum,
mod 2**32): two flipped top bits at word indices of the same parity change
both sums by a multiple of 2**32, so they cancel; a CRC with a degree-32
generator detects every 1- and 2-bit error within its period and every
burst of up to 32 bits. How it runs in XLA without a serial scan: the CRC
without its initial and final XOR is linear over GF(2), so each 16-byte
leaf's value is the XOR of 16 table lookups, and two neighbouring blocks
combine as ``shift(left, len(right)) ^ right`` (``shift``: the left value
carried over that many zero bytes, a 32x32 bit matrix applied as 4 lookups
in 256-entry tables precomputed on the host per level): a tree of log2(n)
levels of vector ops, about 1.5 lookups per byte. Leading zero bytes leave
the raw value unchanged, which pads a chunk to whole leaves and a level to
an even count. The initial value's contribution depends on the length
only: a constant of the program. Alternative not taken: a code of two
sums modulo a prime over bytes (Fletcher-like), which detects every 1- and
2-bit error too and costs less in XLA, but would be a fourth algorithm and
could not be checked against the store's CRC32C of the same bytes.

The frame header (``HEADER``): version, offset, length per row, rows, the
frame's CRC32C (over the header's first 32 bytes and then the rows' bytes
in order), and the header's own CRC32C (over the 36 bytes before it). The
header is checked before its offset or length is trusted (``read_header``):
a corrupt header raises ``CorruptHeader``, a ``ConnectionError``, because
with an untrusted length the stream has lost its framing (the channel is
lost and reconnected; its versions in flight are not committed). A corrupt
body raises the channel's ``CorruptFrame`` for that version alone (the
length was trusted, so the next frame is read). The native frame loops get
the header's C layout from ``HEADER_FIELDS`` (``native_prelude``), so there
is one definition of it.

A header that passes its checksum is still a peer's word: before a byte of
its body is placed, ``frame_rejection`` checks its rows, offset and length
against the buffer, each bound before any sum or product uses it (the
native loop's int64 ``offset + length`` once wrapped past a row). A frame
that fails raises ``FrameRejected`` naming the reason (``REJECTIONS``),
counted per process (``rejected_frames``); the connection is refused with
it. Alternative not taken: skipping such a frame and reading on, which would
trust the length of a header already shown to lie.
"""

from __future__ import annotations

import bisect
import collections
import functools
import struct
import threading
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import crc32c as _crc32c
import numpy as np

POLY = 0x82F63B78
"""CRC32C's generator, reflected."""
HEADER_FIELDS = (("version", "q", "int64_t"), ("offset", "q", "int64_t"),
                 ("length", "q", "int64_t"), ("rows", "q", "int64_t"),
                 ("crc", "I", "uint32_t"), ("head_crc", "I", "uint32_t"))
"""The frame header's fields in order: (name, struct code, C type)."""
HEADER = struct.Struct("<" + "".join(code for _, code, _ in HEADER_FIELDS))
HEADER_BYTES = HEADER.size
FIELD_BYTES = HEADER_BYTES - 8
"""The header's bytes before its two checksums (the frame's CRC starts with them)."""
MAGIC = b"CJX3"
"""The channel format's identity (its hello's first bytes): CJX1 frames had
no checksum, CJX2 a zlib CRC-32 of the rows alone; CJX3 this header."""


MAX_ROWS = 4096
"""The most rows (local devices) a frame may carry: a header naming more is refused."""
MAX_ROW_BYTES = 1 << 48
"""The largest offset or length per row a header may name (256 TiB): a bound
far past any buffer, which keeps ``rows * length`` and ``offset + length``
inside int64 on every path."""
REJECTIONS = ("rows", "negative_offset", "negative_length", "too_long", "past_end", "empty")
"""Why a frame whose header passed its checksum is refused, in the order
checked (``frame_rejection``; the native loop's ``Reject`` codes are their
index + 1): rows outside [1, ``MAX_ROWS``] or not the buffer's, an offset or
length below 0, one past ``MAX_ROW_BYTES``, bytes past the buffer's end, no
bytes at all (no sender sends an empty frame; the native loop would read on
past one within a call where a per-frame reader stops)."""


class Frame(NamedTuple):
    version: int
    offset: int
    length: int
    rows: int
    crc: int


class CorruptHeader(ConnectionError):
    """A frame header that fails its own CRC32C: its length cannot be
    trusted, so neither can the rest of the stream."""


class FrameRejected(ValueError):
    """A frame whose header passed its checksum and names bytes this host
    will not place (``reason``: one of ``REJECTIONS``); the connection is
    refused (its next bytes cannot be trusted to be a header)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{message} (refused: {reason})")
        self.reason = reason


_COUNT_LOCK = threading.Lock()
_REJECTED: collections.Counter[str] = collections.Counter()


def count_rejection(reason: str) -> None:
    """Counts one refused frame or header (``rejected_frames``)."""
    with _COUNT_LOCK:
        _REJECTED[reason] += 1


def rejected_frames() -> dict[str, int]:
    """Frames refused in this process so far, by reason (``REJECTIONS``, and
    ``header_checksum`` for a header that fails its own CRC32C)."""
    with _COUNT_LOCK:
        return dict(_REJECTED)


def frame_rejection(frame_rows: int, offset: int, length: int, rows: int | None = None,
                    cols: int | None = None) -> str | None:
    """Why a frame of ``frame_rows`` x ``length`` bytes at ``offset`` cannot
    be placed in a [rows, cols] buffer (None: it can), without overflow in
    any order of evaluation; ``rows`` None (a frame to discard): only the
    bounds every frame keeps. The native loop applies the same rule
    (``frames.cc:frame_rejection``, tested side by side)."""
    if not 1 <= frame_rows <= MAX_ROWS:
        return "rows"
    if offset < 0:
        return "negative_offset"
    if length < 0:
        return "negative_length"
    if length == 0:
        return "empty"
    if offset > MAX_ROW_BYTES or length > MAX_ROW_BYTES:
        return "too_long"
    if rows is None or cols is None:
        return None
    if frame_rows != rows:
        return "rows"
    if length > cols - offset:
        return "past_end"
    return None


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC32C of a bytes-like object, continuing ``crc`` (the GIL released)."""
    return int(_crc32c.crc32c(data, value=crc))


def frame_crc(fields: bytes, rows: Iterable[Any]) -> int:
    """A frame's CRC32C: its header's first ``FIELD_BYTES`` then its rows."""
    crc = crc32c(fields)
    for row in rows:
        crc = crc32c(row, crc)
    return crc


def pack_header(version: int, offset: int, length: int, rows: Sequence[Any]) -> bytes:
    """The header of a frame carrying ``rows`` (bytes-like, ``length`` each)
    as bytes [offset, offset + length) of ``version``, both CRCs taken now."""
    fields = HEADER.pack(version, offset, length, len(rows), 0, 0)[:FIELD_BYTES]
    crc = frame_crc(fields, rows)
    head = fields + struct.pack("<I", crc)
    return head + struct.pack("<I", crc32c(head))


def read_header(raw: Any) -> Frame:
    """The frame of a received header, checked.

    Raises:
      CorruptHeader: the header fails its CRC32C.
    """
    raw = bytes(raw)
    *fields, head_crc = HEADER.unpack(raw)
    if crc32c(raw[:HEADER_BYTES - 4]) != head_crc:
        count_rejection("header_checksum")
        raise CorruptHeader(f"a frame header fails its checksum (fields as received: "
                            f"{fields[:4]})")
    return Frame(*fields)


class Coverage:
    """The byte ranges of a version received so far against the schedule's.

    ``add`` takes a checked frame's range: a range already received counts
    once (a resend); one that is not inside a scheduled range, or that
    overlaps a received one without being it, is refused (``ValueError``).
    The version is ``complete`` when the union of what came equals the
    schedule's ranges: received ranges all lie inside them and do not
    overlap, so the union's bytes reaching the schedule's means equality.
    Alternative not taken: a count of bytes per frame (a frame written at a
    wrong offset counted, and left a scheduled range unwritten).
    """

    def __init__(self, ranges: Iterable[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for lo, hi in sorted((lo, hi) for lo, hi in ranges if hi > lo):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self._starts = [lo for lo, _ in merged]
        self._ends = [hi for _, hi in merged]
        self.expect = sum(hi - lo for lo, hi in merged)
        self.covered = 0
        self._got: list[tuple[int, int]] = []  # received ranges, sorted, disjoint

    def add(self, lo: int, hi: int) -> bool:
        """Records [lo, hi); whether it was new.

        Raises:
          ValueError: it is outside the schedule's ranges, or overlaps a
            received range without being it.
        """
        i = bisect.bisect_right(self._starts, lo) - 1
        if hi <= lo or i < 0 or hi > self._ends[i]:
            raise ValueError(f"bytes [{lo}, {hi}) are not in the schedule's ranges")
        j = bisect.bisect_left(self._got, (lo, hi))
        if j < len(self._got) and self._got[j] == (lo, hi):
            return False
        if (j > 0 and self._got[j - 1][1] > lo) or (j < len(self._got)
                                                    and self._got[j][0] < hi):
            raise ValueError(f"bytes [{lo}, {hi}) overlap a range already received")
        self._got.insert(j, (lo, hi))
        self.covered += hi - lo
        return True

    @property
    def complete(self) -> bool:
        return self.covered == self.expect

    @property
    def missing(self) -> int:
        """Bytes of a row still due."""
        return self.expect - self.covered


# --- CRC32C inside XLA programs ---

LEAF = 16
"""Bytes per leaf of the in-graph CRC's tree (1 + 8/LEAF lookups per byte)."""


def _byte_table() -> np.ndarray:
    c = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        c = np.where(c & 1, np.uint32(POLY) ^ (c >> 1), c >> 1).astype(np.uint32)
    return c


def _apply(cols: np.ndarray, v: np.ndarray) -> np.ndarray:
    """A 32x32 GF(2) matrix (``cols[j]``: its image of bit j) applied to uint32s."""
    bits = (v[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    return np.bitwise_xor.reduce(np.where(bits.astype(bool), cols, np.uint32(0)), axis=-1)


@functools.cache
def _shift_cols(nbytes: int) -> np.ndarray:
    """The matrix carrying a raw CRC state over ``nbytes`` zero bytes."""
    unit = np.uint32(1) << np.arange(32, dtype=np.uint32)
    table = _byte_table()
    one = table[unit & 0xFF] ^ (unit >> 8)  # one zero byte
    result, power, n = unit.copy(), one, nbytes
    while n:
        if n & 1:
            result = _apply(power, result)
        power = _apply(power, power)
        n >>= 1
    return result


@functools.cache
def _shift_table(nbytes: int) -> np.ndarray:
    """[4 * 256] uint32: the shift over ``nbytes`` of byte k's value b at 256k + b."""
    values = np.arange(256, dtype=np.uint32)
    return np.concatenate([_apply(_shift_cols(nbytes), values << np.uint32(8 * k))
                           for k in range(4)])


@functools.cache
def _leaf_table() -> np.ndarray:
    """[LEAF * 256] uint32: the raw CRC of byte b at position k of a leaf, at 256k + b."""
    table = _byte_table()
    return np.concatenate([_apply(_shift_cols(LEAF - 1 - k), table) for k in range(LEAF)])


def _shift(v: Any, nbytes: int) -> Any:
    import jax.numpy as jnp

    table = jnp.asarray(_shift_table(nbytes))
    out = table[(v & 0xFF).astype(jnp.int32)]
    for k in range(1, 4):
        out = out ^ table[((v >> (8 * k)) & 0xFF).astype(jnp.int32) + 256 * k]
    return out


def crc32c_rows(data: Any) -> Any:
    """CRC32C of each row of a uint8 [k, n] array, uint32 [k], traceable
    (the module docstring's tree); equal to ``crc32c`` of each row's bytes."""
    import jax
    import jax.numpy as jnp

    k, n = data.shape
    if n == 0:
        return jnp.zeros(k, jnp.uint32)
    pad = -n % LEAF
    x = jnp.pad(data, ((0, 0), (pad, 0)))  # leading zeros: the raw CRC is unchanged
    leaves = x.reshape(k, -1, LEAF).astype(jnp.int32) + jnp.arange(LEAF, dtype=jnp.int32) * 256
    v = jax.lax.reduce(jnp.asarray(_leaf_table())[leaves], np.uint32(0),
                       jax.lax.bitwise_xor, (2,))
    size = LEAF
    while v.shape[1] > 1:
        if v.shape[1] % 2:
            v = jnp.pad(v, ((0, 0), (1, 0)))
        pairs = v.reshape(k, -1, 2)
        v = _shift(pairs[..., 0], size) ^ pairs[..., 1]
        size *= 2
    init = int(_apply(_shift_cols(n), np.array([0xFFFFFFFF], np.uint32))[0])
    return v[:, 0] ^ np.uint32(init ^ 0xFFFFFFFF)


def crc32c_device(chunk: Any) -> Any:
    """CRC32C of a uint8 [n] array inside an XLA program, a uint32 scalar."""
    return crc32c_rows(chunk[None])[0]


def crc32c_chunks(flat: Any, chunk_bytes: int) -> Any:
    """CRC32C of each ``chunk_bytes`` piece of a uint8 [n] array (the last
    may be shorter), uint32 [pieces], traceable: one tree for the whole
    pieces and one for the short last one."""
    import jax.numpy as jnp

    whole, rest = divmod(flat.shape[0], chunk_bytes)
    parts = []
    if whole:
        parts.append(crc32c_rows(flat[:whole * chunk_bytes].reshape(whole, chunk_bytes)))
    if rest:
        parts.append(crc32c_rows(flat[whole * chunk_bytes:][None]))
    return jnp.concatenate(parts) if parts else jnp.zeros(0, jnp.uint32)


# --- the native half ---

_CRC_SOURCE = r"""
namespace capricorn_integrity {

uint32_t g_table[8][256];

inline bool init_tables() {
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? POLY ^ (c >> 1) : c >> 1;
    g_table[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (int t = 1; t < 8; ++t)
      g_table[t][i] = (g_table[t - 1][i] >> 8) ^ g_table[0][g_table[t - 1][i] & 0xFF];
  return true;
}

// The raw update (no initial or final XOR), slicing by 8.
inline uint32_t update_tables(uint32_t c, const uint8_t* p, int64_t n) {
  static const bool ready = init_tables();
  (void)ready;
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = g_table[7][lo & 0xFF] ^ g_table[6][(lo >> 8) & 0xFF] ^ g_table[5][(lo >> 16) & 0xFF] ^
        g_table[4][lo >> 24] ^ g_table[3][hi & 0xFF] ^ g_table[2][(hi >> 8) & 0xFF] ^
        g_table[1][(hi >> 16) & 0xFF] ^ g_table[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = g_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) inline uint32_t update_sse42(uint32_t c, const uint8_t* p,
                                                              int64_t n) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = __builtin_ia32_crc32di(c64, v);
    p += 8;
    n -= 8;
  }
  c = static_cast<uint32_t>(c64);
  while (n-- > 0) c = __builtin_ia32_crc32qi(c, *p++);
  return c;
}
#endif

// CRC32C of n bytes, continuing crc (as the crc32c package's crc32c(data, value=crc)).
inline uint32_t crc32c(uint32_t crc, const uint8_t* p, int64_t n) {
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  if (hw) return ~update_sse42(~crc, p, n);
#endif
  return ~update_tables(~crc, p, n);
}

}  // namespace capricorn_integrity
"""


def native_prelude() -> str:
    """C++ that defines ``Header`` (``HEADER_FIELDS``' layout, packed),
    ``capricorn_integrity::crc32c`` and the bounds of ``frame_rejection``
    (``kMaxRows``, ``kMaxRowBytes``, the ``Reject`` codes of
    ``REJECTIONS``): what ``native.frames`` compiles its loops after, so the
    header, the checksum and the bounds have one definition."""
    fields = "\n".join(f"  {ctype} {name};" for name, _, ctype in HEADER_FIELDS)
    reasons = "\n".join(f"  kReject_{name} = {i + 1}," for i, name in enumerate(REJECTIONS))
    return (f"// Generated by capricorn_jax._src.native.integrity: do not edit.\n"
            f"#include <cstdint>\n#include <cstring>\n"
            f"#define POLY 0x{POLY:08X}u\n"
            f"{_CRC_SOURCE}\n#undef POLY\n"
            f"#pragma pack(push, 1)\nstruct Header {{\n{fields}\n}};\n#pragma pack(pop)\n"
            f"static_assert(sizeof(Header) == {HEADER_BYTES}, \"the frame header\");\n"
            f"constexpr int64_t kFieldBytes = {FIELD_BYTES};\n"
            f"constexpr int64_t kMaxRows = {MAX_ROWS};\n"
            f"constexpr int64_t kMaxRowBytes = {MAX_ROW_BYTES}LL;\n"
            f"enum Reject : int64_t {{\n  kFits = 0,\n{reasons}\n}};\n")
