"""The rANS lane decoders agree bit for bit on real demo-model KV streams: the codec's numba
decoder (`vericache_kernels.rans_cpu`), the numpy reference (`rans_ref`) and the Triton kernels
(`rans_triton`, run by the Triton interpreter in a subprocess; on a GPU by
`bench.device_check`), for every level (coarse, pool) and the exact part, bf16 and float32, tables
per channel and per coarser code. Lanes whose words were changed under valid digests are
refused as another writer's (`StreamForeign`), never decoded into wrong KV."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import vericache_kernels as kernels
from tests.support.interpreter import INTERPRETING, interpreter_only, rerun_under_interpreter
from vericache_kernels import rans_cpu, rans_ref
from vericache_sglang.codec import CodecSpec, StreamForeign, decode_chunk, encode_chunk
from vericache_sglang.codec.chunk import Geometry, decode_meta, exact_lanes, level_lanes
from vericache_sglang.codec.stream import read_parts, unpack_sections, write_stream
from vericache_sglang.compress import parse_compressor_spec

CASES = "VERICACHE_RANS_CASES"
"""Where the parent process leaves the lane cases for the interpreter run."""
LAYERS, TOKENS = 2, 32
ONE_PROGRAM = 512
"""Lanes per Triton program in the interpreter run: all of them (its cost is per program)."""
not_interpreting = pytest.mark.skipif(INTERPRETING, reason="runs in the parent process")


def _copy(args: tuple) -> tuple:
    return tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)


def lane_cases(model_kv, dtype: torch.dtype, tables: str,
               lane_channels: int = 16) -> list[tuple[str, tuple, np.ndarray]]:
    """(part kind, a decoder's arguments, what the numba decoder wrote) for every part of a
    small real chunk (2 layers, 32 tokens: the interpreter is slow)."""
    keys, values = (kv[:LAYERS, :TOKENS].to(dtype).contiguous() for kv in model_kv)
    spec = CodecSpec.for_compressor(parse_compressor_spec("kivi:bits=4"), LAYERS, tables=tables,
                                    lane_channels=lane_channels)
    assert len(spec.levels) == 2  # a coarse level and the pool level
    header, parts = read_parts(encode_chunk(keys, values, spec))
    geo = Geometry(header)
    codes = np.zeros((LAYERS, 2, geo.codes), dtype=np.uint8)
    sections0 = unpack_sections(parts[0], 4)
    cases = []
    for index in range(len(header.levels)):
        sections = sections0[1:] if index == 0 else unpack_sections(parts[index], 3)
        args = _copy(level_lanes(geo, sections, index, codes))
        assert rans_cpu.decode_level(*level_lanes(geo, sections, index, codes))
        cases.append(("level", args, codes.copy()))
    out = np.zeros((2 * LAYERS, geo.codes), dtype=np.int64)
    args, planes = exact_lanes(geo, parts[-1], codes, decode_meta(sections0[0], geo), out)
    assert args is not None and len(planes) < LAYERS
    words, starts, exp_cum, residual, c, scales, zeros, model, *rest = args
    assert rans_cpu.decode_exact(words, starts, exp_cum, residual, c, scales, zeros, *model,
                                 *rest)
    expected = torch.stack([keys.reshape(LAYERS, -1), values.reshape(LAYERS, -1)], 1)
    assert np.array_equal(out.reshape(LAYERS, 2, -1)[residual],
                          _unsigned(expected, dtype)[residual])
    cases.append(("exact", _copy(args[:-1]) + (np.zeros_like(out),), out.copy()))
    return cases


def _unsigned(x: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    bits = 32 if dtype == torch.float32 else 16
    ints = x.view(torch.int32 if bits == 32 else torch.int16).numpy().astype(np.int64)
    return ints & ((1 << bits) - 1)


def all_cases(model_kv, lane_channels: int = 16) -> dict[str, list]:
    return {f"{dtype}-{tables}": lane_cases(model_kv, dtype, tables, lane_channels)
            for dtype in (torch.bfloat16, torch.float32) for tables in ("channel", "kind")}


@pytest.fixture(scope="module")
def cases(model_kv) -> dict[str, list]:
    return all_cases(model_kv)


@not_interpreting
def test_the_numpy_reference_decodes_what_numba_decodes(cases):
    for name, part_cases in cases.items():
        for kind, args, want in part_cases:
            args = _copy(args)
            if kind == "level":
                assert rans_ref.decode_level_ref(*args), name
                assert np.array_equal(args[7], want), name
            else:
                assert rans_ref.decode_exact_ref(*args), name
                assert np.array_equal(args[-1], want), name


@not_interpreting
def test_the_triton_kernels_decode_what_numba_decodes(model_kv, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch):
    """Lanes of 2 channels: the interpreter's time goes with a lane's length."""
    path = tmp_path / "cases.pkl"
    path.write_bytes(pickle.dumps(all_cases(model_kv, lane_channels=2)))
    monkeypatch.setenv(CASES, str(path))
    rerun_under_interpreter(__file__, skipped=6)


@interpreter_only
def test_triton_lanes():
    """In the interpreter run: every case of the parent's, through the Triton kernels."""
    from vericache_kernels import rans_triton

    cases = pickle.loads(Path(os.environ[CASES]).read_bytes())
    for name, part_cases in cases.items():
        for kind, args, want in part_cases:
            args = _copy(args)
            if kind == "level":
                codes = torch.from_numpy(args[7])
                assert rans_triton.decode_level_triton(*args[:7], codes, *args[8:],
                                                       block=ONE_PROGRAM), name
                assert np.array_equal(codes.numpy(), want), name
            else:
                out = torch.from_numpy(args[-1])
                codes = torch.from_numpy(args[4])
                assert rans_triton.decode_exact_triton(*args[:4], codes, *args[5:-1], out,
                                                       block=ONE_PROGRAM), name
                assert np.array_equal(out.numpy(), want), name


@not_interpreting
def test_lanes_changed_under_valid_digests_are_refused(model_kv):
    """Another writer's stream whose lanes do not decode (a word changed, digests recomputed):
    every decoder reports it, and the codec raises StreamForeign."""
    keys, values = (kv[:LAYERS, :TOKENS].bfloat16().contiguous() for kv in model_kv)
    spec = CodecSpec.for_compressor(parse_compressor_spec("kivi:bits=4"), LAYERS)
    header, parts = read_parts(encode_chunk(keys, values, spec))
    fields = {k: v for k, v in header.__dict__.items() if k not in ("part_lengths",
                                                                    "part_digests")}
    for part in range(header.num_parts):
        damaged = [bytearray(p) for p in parts]
        damaged[part][-3] ^= 0x10  # a word of the part's last lane
        blob = write_stream(fields, [bytes(p) for p in damaged])
        level = part if part < len(header.levels) else None
        with pytest.raises(StreamForeign, match="does not decode"):
            decode_chunk(blob, level=level)


@not_interpreting
def test_the_numba_normalize_is_the_references():
    """The decoders' tables: numba's `normalize_into` equals `rans_ref.normalize`, ties of the
    largest count, empty tables and padding included; so does `normalize_blocks`, a part's
    blocks of several widths in one call."""
    rng = np.random.default_rng(0)
    tables = rng.integers(0, 256, (300, 16)).astype(np.uint8)
    tables[::7] = 0
    tables[1::7, :4] = 255
    tables[2::7] = rng.integers(0, 2, (len(tables[2::7]), 16))
    for symbols, width in ((2, 1), (4, 2), (4, 4), (16, 4), (16, 8)):
        t = np.ascontiguousarray(tables[:, :symbols])
        cum = np.zeros((len(t), (1 << width) + 1), dtype=np.int64)
        rans_cpu.normalize_into(t, cum)
        assert np.array_equal(cum, rans_ref.normalize(t, width)), (symbols, width)
    blocks = [np.ascontiguousarray(tables[first:first + rows, :symbols])
              for first, rows, symbols in ((0, 100, 16), (100, 7, 4), (107, 193, 2))]
    cum = np.zeros((300, 17), dtype=np.int64)
    rans_cpu.normalize_blocks(np.concatenate([b.ravel() for b in blocks]),
                              np.array([b.shape for b in blocks], dtype=np.int64), cum)
    assert np.array_equal(cum, np.concatenate([rans_ref.normalize(b, 4) for b in blocks]))


@not_interpreting
def test_a_narrower_last_lane_decodes(model_kv):
    """Lanes of 5 channels: each (layer, kind)'s 192 channels end in a lane of 2, which the
    numba decoder takes apart from its lockstep blocks; the reference agrees bit for bit."""
    for dtype in (torch.bfloat16, torch.float32):
        for tables in ("channel", "kind"):
            for kind, args, want in lane_cases(model_kv, dtype, tables, lane_channels=5):
                args = _copy(args)
                if kind == "level":
                    assert rans_ref.decode_level_ref(*args)
                    assert np.array_equal(args[7], want)
                else:
                    assert rans_ref.decode_exact_ref(*args)
                    assert np.array_equal(args[-1], want)


@not_interpreting
def test_the_numba_packing_is_the_pools():
    """The decoded codes packed by `rans_cpu.pack_codes` are `vericache_kernels.pack_codes`'s
    pages, byte for byte."""
    rng = np.random.default_rng(0)
    for bits in (2, 4, 8):
        codes = rng.integers(0, 1 << bits, (3, 2, 8 * 3 * 64 * 32)).astype(np.uint8)
        layers = np.array([2, 0], dtype=np.int64)
        for kind in (0, 1):
            want = kernels.pack_codes(torch.from_numpy(codes[layers, kind]), bits).numpy()
            assert np.array_equal(rans_cpu.pack_codes(codes, layers, kind, bits), want), bits
