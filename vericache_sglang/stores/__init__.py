"""KV stores: SGLang's storage backends as VeriCache stores pages (`file`, `mooncake`), and what
they share (`pages`). A real Mooncake store for tests and benchmarks: `vericache_tools`."""

BACKENDS = {"file": ("vericache_sglang.stores.file", "FileBackend"),
            "mooncake": ("vericache_sglang.stores.mooncake", "MooncakeBackend")}
"""SGLang's built-in backend names VeriCache builds, and the classes that build them."""


def import_backend(name: str | None) -> None:
    """Import the store module SGLang will build for backend `name` (loading is lazy
    otherwise), so that the SGLang internals it touches are declared for the startup check."""
    import importlib

    if name in BACKENDS:
        importlib.import_module(BACKENDS[name][0])


def register() -> None:
    """Have SGLang's storage factory build these names through VeriCache's classes, which
    give a server without VeriCache SGLang's own backend (the plugin calls this in every
    process; SGLang logs that each name is overwritten). Loading stays lazy. A reloaded
    prefix's compressed pages come from the stored stream (`load_back`)."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.plugins.hook_registry import HookType

    from vericache_sglang.integration.hooks import hook

    from .load_back import (
        BUFFER_LOAD_BACK,
        LOAD_BACK,
        install_reloaded_codes,
        install_staged_codes,
    )

    for name, (module, cls) in BACKENDS.items():
        StorageBackendFactory.register_backend(name, module, cls)
    hook(LOAD_BACK, install_reloaded_codes, HookType.AROUND)
    hook(BUFFER_LOAD_BACK, install_staged_codes, HookType.AFTER)
