"""KV stores: SGLang's storage backends as VeriCache stores pages (`file`, `mooncake`), what
they share (`pages`), and a real Mooncake store for tests and benchmarks (`mooncake_service`)."""

BACKENDS = {"file": ("vericache_sglang.stores.file", "FileBackend"),
            "mooncake": ("vericache_sglang.stores.mooncake", "MooncakeBackend")}
"""SGLang's built-in backend names VeriCache builds, and the classes that build them."""


def register() -> None:
    """Have SGLang's storage factory build these names through VeriCache's classes, which
    give a server without VeriCache SGLang's own backend (the plugin calls this in every
    process; SGLang logs that each name is overwritten). Loading stays lazy."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    for name, (module, cls) in BACKENDS.items():
        StorageBackendFactory.register_backend(name, module, cls)
