"""Spec strings, the registry and the dataclass style of the methods."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vericache_sglang.compress as vc
from vericache_sglang.compress import (
    ComposedCompressor,
    Compressor,
    CompressorSpecError,
    TokenDropper,
    available_compressors,
    parse_compressor_spec,
    register_compressor,
)
from vericache_sglang.compress import registry as registry_module
from vericache_sglang.compress.params import param, spec_params

BUILTIN = {"kivi", "kivi_mixed", "streaming", "snapkv", "h2o"}
EXAMPLES = [
    "kivi:bits=4,group=32,residual=128",
    "streaming:sink=4,ratio=0.25",
    "snapkv:ratio=0.25",
    "h2o:ratio=0.2",
    "snapkv:ratio=0.5+kivi:bits=4",
    "kivi_mixed:bits_early=8,bits_late=2,early_layers=2,recent_bits=4,recent=64,group=32",
    " kivi : bits = 2 ",
    "streaming",
]


def test_builtins_are_registered() -> None:
    assert BUILTIN <= set(available_compressors())


@pytest.mark.parametrize("spec", EXAMPLES)
def test_spec_round_trip(spec: str) -> None:
    c = parse_compressor_spec(spec)
    assert parse_compressor_spec(c.spec()) == c
    assert c.spec() == parse_compressor_spec(c.spec()).spec()


def test_values_are_applied() -> None:
    c = parse_compressor_spec("kivi:bits=2,group=64,residual=0")
    assert (c.bits, c.group, c.residual) == (2, 64, 0)
    c = parse_compressor_spec("snapkv:ratio=0.5+kivi:bits=8")
    assert isinstance(c, ComposedCompressor)
    assert (c.dropper.ratio, c.quantizer.bits) == (0.5, 8)
    assert c.needs_scores and c.score_window() == c.dropper.window


def _method_classes() -> list[type[Compressor]]:
    return [registry_module._REGISTRY[name] for name in sorted(BUILTIN)]


@pytest.mark.parametrize("cls", _method_classes(), ids=lambda c: c.name)
def test_method_style(cls: type[Compressor]) -> None:
    """One file of 30-100 lines per method; its fields are exactly its spec keys, documented."""
    source = inspect.getsource(sys.modules[cls.__module__])
    assert 30 <= len(source.splitlines()) <= 100
    fields = [f.name for f in dataclasses.fields(cls)]
    assert fields == list(spec_params(cls))
    keys = [kv.split("=")[0] for kv in cls().spec().split(":", 1)[1].split(",")]
    assert keys == fields
    class_source = inspect.getsource(cls)
    for name in fields:
        line = next(i for i, s in enumerate(class_source.splitlines())
                    if s.strip().startswith(f"{name}:"))
        assert class_source.splitlines()[line + 1].strip().startswith('"""'), name


BAD_SPECS = [
    ("nosuch:bits=4", "nosuch", "kivi"),
    ("kivi:bitz=4", "bitz", "bits (int"),
    ("kivi:bits=four", "bits", "one of 2, 4, 8"),
    ("kivi:bits=3", "bits", "one of 2, 4, 8"),
    ("kivi:group=30", "group", "multiple of 4"),
    ("kivi:residual=-1", "residual", ">= 0"),
    ("kivi:bits=4,bits=2", "bits", "twice"),
    ("kivi:bits", "bits", "key=value"),
    ("kivi:bits=4,", "kivi", "key=value"),
    ("streaming:ratio=0", "ratio", "> 0.0"),
    ("streaming:ratio=1.5", "ratio", "<= 1.0"),
    ("streaming:ratio=nan", "ratio", "<= 1.0"),
    ("streaming:sink=2.5", "sink", "int"),
    ("snapkv:kernel=4", "kernel", "odd"),
    ("snapkv:pooling=median", "pooling", "max, avg"),
    ("kivi_mixed:recent=48", "recent", "multiple of group"),
    ("kivi:bits=4+snapkv:ratio=0.5", "dropper then a quantizer", "snapkv"),
    ("snapkv+h2o", "dropper then a quantizer", "h2o"),
    ("snapkv+kivi+kivi", "two parts", "+"),
    ("", "available", "kivi"),
    ("+kivi", "two parts", "quantizer"),
]


@pytest.mark.parametrize(("spec", "names", "valid"), BAD_SPECS)
def test_bad_specs_raise_one_clear_error(spec: str, names: str, valid: str) -> None:
    with pytest.raises(CompressorSpecError) as err:
        parse_compressor_spec(spec)
    assert isinstance(err.value, ValueError)
    assert names in str(err.value) and valid in str(err.value)


def test_constructor_validates_like_the_parser() -> None:
    kivi_cls = type(parse_compressor_spec("kivi"))
    with pytest.raises(CompressorSpecError, match="kivi: parameter 'bits'"):
        kivi_cls(bits=5)
    with pytest.raises(CompressorSpecError, match="parameter 'group' must be int"):
        kivi_cls(group="32")
    streaming_cls = type(parse_compressor_spec("streaming"))
    assert streaming_cls(ratio=1).ratio == 1.0 and isinstance(streaming_cls(ratio=1).ratio, float)


_names = st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True)


@settings(max_examples=40, deadline=None)
@given(_names)
def test_unknown_methods(name: str) -> None:
    if name in available_compressors():
        return
    with pytest.raises(CompressorSpecError, match=f"unknown compressor '{name}'.*available: "):
        parse_compressor_spec(f"{name}:ratio=0.5")


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(BUILTIN)), _names, st.text(max_size=8))
def test_unknown_or_bad_parameters(method: str, key: str, raw: str) -> None:
    params = spec_params(registry_module._REGISTRY[method])
    raw = raw.replace(",", "").replace("+", "").replace("=", "")
    spec = f"{method}:{key}={raw}"
    if key not in params:
        with pytest.raises(CompressorSpecError, match=f"{method}: unknown parameter '{key}'"):
            parse_compressor_spec(spec)
        return
    try:
        c = parse_compressor_spec(spec)
    except CompressorSpecError as e:
        assert f"{method}: parameter '{key}'" in str(e) and "valid" in str(e)
    else:
        assert parse_compressor_spec(c.spec()) == c


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(BUILTIN)), st.data())
def test_out_of_range_numbers(method: str, data: st.DataObject) -> None:
    cls = registry_module._REGISTRY[method]
    name, (f, typ) = data.draw(st.sampled_from(
        [(n, ft) for n, ft in spec_params(cls).items() if ft[1] in (int, float)]
    ))
    value = data.draw(st.integers(-10**6, 10**6) if typ is int
                      else st.floats(-10, 10, allow_nan=False))
    meta = f.metadata["param"]
    in_range = all([
        meta["choices"] is None or value in meta["choices"],
        meta["ge"] is None or value >= meta["ge"],
        meta["gt"] is None or value > meta["gt"],
        meta["le"] is None or value <= meta["le"],
        meta["multiple_of"] is None or value % meta["multiple_of"] == 0,
    ])
    spec = f"{method}:{name}={value!r}"
    if in_range:
        try:
            c = parse_compressor_spec(spec)
        except CompressorSpecError as e:  # only cross-parameter checks may still object
            assert f"parameter '{name}'" in str(e) or "parameter 'recent'" in str(e)
        else:
            assert getattr(c, name) == value
    else:
        with pytest.raises(CompressorSpecError, match=f"{method}: parameter '{name}'"):
            parse_compressor_spec(spec)


@dataclasses.dataclass(frozen=True)
class EveryOther(TokenDropper):
    """A user's dropper, defined outside the package: keeps every other token."""

    ratio: float = param(0.5, gt=0.0, le=1.0)
    """Kept fraction."""

    def score(self, keys, values, acc):
        n = keys.shape[0]
        return (torch.arange(n) % 2 == 0).float()[None].expand(keys.shape[1], -1)


def test_user_registered_compressor() -> None:
    register_compressor("test_every_other")(EveryOther)
    try:
        c = parse_compressor_spec("test_every_other:ratio=0.5+kivi:bits=8,residual=0,group=4")
        keys = torch.randn(10, 2, 8)
        block = c.compress(keys, keys, torch.arange(10))
        assert block.positions().tolist() == [[0, 2, 4, 6, 8]] * 2
        with pytest.raises(ValueError, match="already registered"):
            register_compressor("test_every_other")(type("Other", (EveryOther,), {}))
    finally:
        del registry_module._REGISTRY["test_every_other"]


PLUGIN_SOURCE = '''
from dataclasses import dataclass

import torch

from vericache_sglang.compress import TokenDropper, param, register_compressor


@register_compressor("test_plugin_newest")
@dataclass(frozen=True)
class Newest(TokenDropper):
    ratio: float = param(0.5, gt=0.0, le=1.0)
    """Kept fraction."""

    def score(self, keys, values, acc):
        return torch.arange(keys.shape[0], dtype=torch.float32)[None].expand(keys.shape[1], -1)
'''


def test_entry_point_plugin(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A package of one's own declares an entry point; it registers on first use of the API."""
    (tmp_path / "my_vc_plugin.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = EntryPoint("newest", "my_vc_plugin", registry_module.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry_module, "entry_points",
                        lambda group: [ep] if group == registry_module.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(registry_module, "_plugins_loaded", False)
    try:
        assert "test_plugin_newest" in vc.available_compressors()
        keys = torch.randn(8, 1, 4)
        block = parse_compressor_spec("test_plugin_newest:ratio=0.25").compress(
            keys, keys, torch.arange(8)
        )
        assert block.positions().tolist() == [[6, 7]]
    finally:
        registry_module._REGISTRY.pop("test_plugin_newest", None)
        sys.modules.pop("my_vc_plugin", None)


def test_broken_plugin_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = EntryPoint("broken", "no_such_module_for_vc", registry_module.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry_module, "entry_points", lambda group: [ep])
    monkeypatch.setattr(registry_module, "_plugins_loaded", False)
    with pytest.raises(RuntimeError, match="plugin 'broken'"):
        available_compressors()


def test_ratio_vs_bf16_orders_bits() -> None:
    ratios = [parse_compressor_spec(f"kivi:bits={b}").ratio_vs_bf16(4096, 3, 64)
              for b in (8, 4, 2)]
    assert 1 < ratios[0] < ratios[1] < ratios[2] < 8
    assert parse_compressor_spec("streaming:ratio=0.25").ratio_vs_bf16(4096, 3, 64) < 4


def test_docs_example_compressor_works(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 'add a compressor' example in docs/compressors.md runs as written."""
    docs = Path(__file__).resolve().parents[2] / "docs" / "compressors.md"
    source = docs.read_text().split("# my_package/knorm.py\n", 1)[1].split("```", 1)[0]
    module = types.ModuleType("knorm_example")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(source, "knorm_example.py", "exec", dont_inherit=True), module.__dict__)
    try:
        keys = torch.randn(12, 2, 8)
        keys[3] *= 0.01  # the smallest key norm in both heads
        block = parse_compressor_spec("knorm:ratio=0.25").compress(keys, keys, torch.arange(12))
        assert len(block) == 3 and (block.positions() == 3).any(dim=1).all()
    finally:
        registry_module._REGISTRY.pop("knorm", None)
