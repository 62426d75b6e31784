"""The codec's container: a self-describing stream of parts, each with its own digest.

    b"VCKV" | version u8 | header length u32 | header (JSON) | header digest (16 B) | parts...

The header names everything a decoder needs (shapes, dtype, levels, table grouping, each part's
length and digest) and its digest covers the magic, version and header bytes. A part's digest is
keyed by the stream's key (e.g. the storage page key) and the part's index, so a part from
another stream or another position, or a stream stored under another key, is refused. A stream
cut short still decodes the levels whose parts arrived whole: that is what makes it progressive.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass

MAGIC = b"VCKV"
VERSION = 1
DIGEST_BYTES = 16
_PREFIX = struct.Struct("<4sBI")


class StreamError(ValueError):
    """A stream that is truncated, corrupted, foreign or of an unknown version: never decoded."""


@dataclass(frozen=True)
class Header:
    """What a stream holds. `levels[i][layer]` is the bits of lossy level i for that layer; the
    last lossy level is the compressed pool's own pages; `exact` says whether a last part holds
    the exactly coded residual."""

    layers: int
    tokens: int
    heads: int
    head_dim: int
    dtype: str
    group: int
    v_group: int
    levels: list[list[int]]
    tables: str
    exact: bool
    part_lengths: list[int]
    part_digests: list[str]

    @property
    def num_parts(self) -> int:
        return len(self.part_lengths)


def _part_digest(key: bytes, index: int, part: bytes | memoryview) -> str:
    return hashlib.blake2b(part, digest_size=DIGEST_BYTES, key=key[:64],
                           person=struct.pack("<Q", index)).hexdigest()


def write_stream(fields: dict, parts: list[bytes], key: bytes = b"") -> bytes:
    """The stream of `parts` under a header made of `fields` (every `Header` field but the
    part lengths and digests)."""
    header = Header(**fields, part_lengths=[len(p) for p in parts],
                    part_digests=[_part_digest(key, i, p) for i, p in enumerate(parts)])
    text = json.dumps(asdict(header), separators=(",", ":")).encode()
    head = _PREFIX.pack(MAGIC, VERSION, len(text)) + text
    digest = hashlib.blake2b(head, digest_size=DIGEST_BYTES).digest()
    return b"".join([head, digest, *parts])


def read_header(blob: bytes | memoryview) -> tuple[Header, int]:
    """The header of `blob` and the offset of its first part; refuses a foreign or damaged one."""
    view = memoryview(blob)
    if len(view) < _PREFIX.size:
        raise StreamError(f"not a VeriCache KV stream: {len(view)} bytes")
    magic, version, length = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise StreamError(f"not a VeriCache KV stream (magic {bytes(magic)!r})")
    if version != VERSION:
        raise StreamError(f"KV stream version {version}; this codec reads version {VERSION}")
    end = _PREFIX.size + length
    if len(view) < end + DIGEST_BYTES:
        raise StreamError("KV stream truncated inside its header")
    digest = hashlib.blake2b(view[:end], digest_size=DIGEST_BYTES).digest()
    if digest != bytes(view[end:end + DIGEST_BYTES]):
        raise StreamError("KV stream header corrupted (digest mismatch)")
    try:
        header = Header(**json.loads(bytes(view[_PREFIX.size:end])))
    except (TypeError, ValueError) as e:
        raise StreamError(f"KV stream header unreadable: {e}") from None
    return header, end + DIGEST_BYTES


def read_parts(blob: bytes | memoryview, count: int | None = None,
               key: bytes = b"") -> tuple[Header, list[memoryview]]:
    """The header and the first `count` parts (all when None), each checked against its digest.
    Bytes past the last part are refused, so two streams glued together are not read as one."""
    header, offset = read_header(blob)
    view = memoryview(blob)
    count = header.num_parts if count is None else count
    if not 0 <= count <= header.num_parts:
        raise StreamError(f"asked for {count} parts of a stream of {header.num_parts}")
    parts = []
    for i in range(count):
        length = header.part_lengths[i]
        part = view[offset:offset + length]
        if len(part) != length:
            raise StreamError(f"KV stream truncated in part {i} ({len(part)} of {length} bytes)")
        if _part_digest(key, i, part) != header.part_digests[i]:
            raise StreamError(f"KV stream part {i} corrupted or not this stream's (digest "
                              "mismatch)")
        parts.append(part)
        offset += length
    if count == header.num_parts and offset != len(view):
        raise StreamError(f"{len(view) - offset} unexpected bytes after the KV stream's last part")
    return header, parts


def prefix_length(header: Header, parts: int) -> int:
    """Bytes of the stream's header and first `parts` parts: what to fetch for that level."""
    text = json.dumps(asdict(header), separators=(",", ":")).encode()
    return _PREFIX.size + len(text) + DIGEST_BYTES + sum(header.part_lengths[:parts])


def parts_in(header: Header, size: int) -> int:
    """How many whole parts the first `size` bytes of the stream hold."""
    end = prefix_length(header, 0)
    for index, length in enumerate(header.part_lengths):
        end += length
        if end > size:
            return index
    return header.num_parts


_SECTION = struct.Struct("<I")


def pack_sections(sections: list[bytes]) -> bytes:
    """Length-prefixed sections inside one part."""
    return b"".join(_SECTION.pack(len(s)) + s for s in sections)


def unpack_sections(part: memoryview, count: int) -> list[memoryview]:
    """Inverse of `pack_sections`: exactly `count` sections filling the part."""
    out, offset = [], 0
    for _ in range(count):
        if offset + _SECTION.size > len(part):
            raise StreamError("KV stream part ends inside a section header")
        (length,) = _SECTION.unpack_from(part, offset)
        offset += _SECTION.size
        if offset + length > len(part):
            raise StreamError("KV stream part ends inside a section")
        out.append(part[offset:offset + length])
        offset += length
    if offset != len(part):
        raise StreamError("KV stream part has bytes after its last section")
    return out
