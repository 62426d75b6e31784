"""The codec's container: a self-describing stream of parts, each with its own digest.

    b"VCKV" | version u8 | header length u32 | header (JSON) | header digest (16 B) | parts...

The header names everything a decoder needs (shapes, dtype, levels, table grouping, each part's
length and digest) and its digest (BLAKE2b) covers the magic, version and header bytes. A part's
digest is XXH3-128 seeded by a BLAKE2b hash of the whole of the stream's key (e.g. the storage
page key, its rank suffix included) and the part's index, so a part from another stream or
another position, or a stream stored under another key, is refused. XXH3 is not cryptographic:
it catches damage, truncation and misplaced parts or keys (a wrong one passes with probability
about 2**-64, the seed's size), not a writer who forges a part on purpose; neither did the
keyed BLAKE2b before it, since the key is a page's name, not a secret. A stream cut short still
decodes the levels whose parts arrived whole: that is what makes it progressive.

A stream that is not decoded raises one of `StreamError`'s kinds, which tell a store what to do
with the object: `StreamCorrupt` (a digest fails: the bytes are not what was written, the only
proof of damage), `StreamTruncated` (it ends before its header or parts do) and `StreamForeign`
(another format or version, or bytes that passed their digests but that this codec or this
reader's configuration does not take: valid data of another writer).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass

import xxhash

MAGIC = b"VCKV"
VERSION = 4
"""4: part digests XXH3-128 (version 3's keyed BLAKE2b took 1.3-1.9 ms of a level-0 decode);
3: parts coded in independent rANS lanes (the header's `lane_channels`); 2 range coded each part
as one sequence; 1 keyed part digests by the first 64 bytes of the key."""
DIGEST_BYTES = 16
_PREFIX = struct.Struct("<4sBI")
_MAC_PERSON = b"vericache-kv-mac"


class StreamError(ValueError):
    """A stream that is never decoded; raised as one of the kinds below."""


class StreamTruncated(StreamError):
    """The stream ends before its header or a part it was asked for does."""


class StreamCorrupt(StreamError):
    """A digest fails: the header or a part is not what its writer stored under this key."""


class StreamForeign(StreamError):
    """Another format or version, or a stream whose digests pass but that this reader does not
    take (another writer's configuration, or a layout this codec cannot decode)."""


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
    lane_channels: int
    part_lengths: list[int]
    part_digests: list[str]

    @property
    def num_parts(self) -> int:
        return len(self.part_lengths)


def _mac_key(key: bytes) -> bytes:
    """The parts' key: a hash of the whole stream key (a storage key's tail, e.g. its rank,
    must count)."""
    return hashlib.blake2b(key, person=_MAC_PERSON).digest()


def _part_digest(mac: bytes, index: int, part: bytes | memoryview) -> str:
    """XXH3-128 of the part, seeded by the key and the part's index (a 64-bit seed from a
    keyed BLAKE2b of the index: XXH3 takes no longer key). 0.04-0.06 ms for a 1.2 MB part
    where BLAKE2b took 1.3-1.9."""
    seed = hashlib.blake2b(struct.pack("<Q", index), digest_size=8, key=mac).digest()
    return xxhash.xxh3_128_hexdigest(part, seed=int.from_bytes(seed, "little"))


def write_stream(fields: dict, parts: list[bytes], key: bytes = b"") -> bytes:
    """The stream of `parts` under a header made of `fields` (every `Header` field but the
    part lengths and digests)."""
    mac = _mac_key(key)
    header = Header(**fields, part_lengths=[len(p) for p in parts],
                    part_digests=[_part_digest(mac, i, p) for i, p in enumerate(parts)])
    text = json.dumps(asdict(header), separators=(",", ":")).encode()
    head = _PREFIX.pack(MAGIC, VERSION, len(text)) + text
    digest = hashlib.blake2b(head, digest_size=DIGEST_BYTES).digest()
    return b"".join([head, digest, *parts])


def read_header(blob: bytes | memoryview) -> tuple[Header, int]:
    """The header of `blob` and the offset of its first part; refuses a foreign or damaged one."""
    view = memoryview(blob)
    if len(view) < _PREFIX.size:
        raise StreamTruncated(f"KV stream truncated: {len(view)} bytes")
    magic, version, length = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise StreamForeign(f"not a VeriCache KV stream (magic {bytes(magic)!r})")
    if version != VERSION:
        raise StreamForeign(f"KV stream version {version}; this codec reads version {VERSION}")
    end = _PREFIX.size + length
    if len(view) < end + DIGEST_BYTES:
        raise StreamTruncated("KV stream truncated inside its header")
    digest = hashlib.blake2b(view[:end], digest_size=DIGEST_BYTES).digest()
    if digest != bytes(view[end:end + DIGEST_BYTES]):
        raise StreamCorrupt("KV stream header corrupted (digest mismatch)")
    try:
        header = Header(**json.loads(bytes(view[_PREFIX.size:end])))
    except (TypeError, ValueError) as e:  # its digest passed: a writer's, not ours
        raise StreamForeign(f"KV stream header unreadable: {e}") from None
    return header, end + DIGEST_BYTES


def read_parts(blob: bytes | memoryview, count: int | None = None,
               key: bytes = b"") -> tuple[Header, list[memoryview]]:
    """The header and the first `count` parts (all when None), each checked against its digest.
    Bytes past the last part are refused, so two streams glued together are not read as one."""
    header, offset = read_header(blob)
    view = memoryview(blob)
    count = header.num_parts if count is None else count
    if not 0 <= count <= header.num_parts:
        raise StreamForeign(f"asked for {count} parts of a stream of {header.num_parts}")
    mac = _mac_key(key)
    parts = []
    for i in range(count):
        length = header.part_lengths[i]
        part = view[offset:offset + length]
        if len(part) != length:
            raise StreamTruncated(f"KV stream truncated in part {i} ({len(part)} of {length} "
                                  "bytes)")
        if _part_digest(mac, i, part) != header.part_digests[i]:
            raise StreamCorrupt(f"KV stream part {i} corrupted or not this stream's (digest "
                                "mismatch)")
        parts.append(part)
        offset += length
    if count == header.num_parts and offset != len(view):
        raise StreamCorrupt(f"{len(view) - offset} unexpected bytes after the KV stream's last "
                            "part")
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
    """Inverse of `pack_sections`: exactly `count` sections filling the part. The part passed
    its digest, so a layout that does not fit is another writer's (`StreamForeign`)."""
    out, offset = [], 0
    for _ in range(count):
        if offset + _SECTION.size > len(part):
            raise StreamForeign("KV stream part ends inside a section header")
        (length,) = _SECTION.unpack_from(part, offset)
        offset += _SECTION.size
        if offset + length > len(part):
            raise StreamForeign("KV stream part ends inside a section")
        out.append(part[offset:offset + length])
        offset += length
    if offset != len(part):
        raise StreamForeign("KV stream part has bytes after its last section")
    return out


def unpack_all(part: memoryview) -> list[memoryview]:
    """Every section of a part whose section count its first section tells."""
    out, offset = [], 0
    while offset < len(part):
        (section,) = unpack_sections(part[offset:offset + _SECTION.size + _length(part, offset)],
                                     1)
        out.append(section)
        offset += _SECTION.size + len(section)
    return out


def _length(part: memoryview, offset: int) -> int:
    if offset + _SECTION.size > len(part):
        raise StreamForeign("KV stream part ends inside a section header")
    return _SECTION.unpack_from(part, offset)[0]
