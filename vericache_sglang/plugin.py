"""SGLang plugin entry point (group `sglang.srt.plugins`, name `vericache`).

SGLang calls `register()` in every process it starts, before arguments are parsed. It adds
VeriCache's flags to the launcher, carries the resolved settings to the scheduler on the
server-args record, reports them in `/server_info`, accepts them as `sglang.Engine` keyword
arguments, and on a machine without a GPU selects SGLang's CPU engine and device and lets
SGLang's own hierarchical cache run there.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from vericache_sglang import startup, stores
from vericache_sglang.config import (
    VeriCacheConfig,
    VeriCacheConfigError,
    add_cli_args,
    attach_config,
    get_config,
    option_names,
)
from vericache_sglang.cpu import hicache as cpu_hicache
from vericache_sglang.cpu import lazy_kv, moe_gate, softcap
from vericache_sglang.cpu.finder import install as install_cpu_support
from vericache_sglang.integration import hooks
from vericache_sglang.integration.hooks import hook
from vericache_sglang.integration.internals import internal
from vericache_sglang.speculative import configure as configure_spec
from vericache_sglang.speculative import meta_info
from vericache_sglang.speculative import register as register_spec
from vericache_sglang.stores.pending import check_early_drafting
from vericache_sglang.tiers import budget, disk, placement

logger = logging.getLogger(__name__)

SERVER_ARGS = "sglang.srt.server_args.ServerArgs"


def _add_cli_args(original, parser):
    original(parser)
    add_cli_args(parser)


def _from_cli_args(original, cls, args):
    server_args = original(cls, args)
    try:
        config = VeriCacheConfig.build({name: getattr(args, name, None) for name in option_names()})
    except VeriCacheConfigError as e:
        # One readable line and exit status 1 instead of a traceback.
        raise startup.error(str(e)) from None
    attach_config(server_args, config)
    _configure(server_args)
    if config.enable_vericache:
        logger.info("VeriCache enabled: %s", config.to_dict())
    return server_args


def _resolved_dict(result: dict[str, Any], server_args) -> dict[str, Any]:
    result["vericache"] = get_config(server_args).to_dict()
    return result


def _scheduler_init_info(result: dict[str, Any], scheduler) -> dict[str, Any]:
    """The scheduler's handshake (merged into `/server_info` over the settings): the settings
    plus what the compressed and full KV take on the device, measured where they live."""
    worker = scheduler.draft_worker
    if hasattr(worker, "memory_report"):
        result["vericache"] = {**get_config(scheduler.server_args).to_dict(),
                               "memory": worker.memory_report()}
    return result


def _scheduler_internal_state(result, scheduler, *args: Any):
    """`/server_info` `internal_states`: VeriCache's running state (device bytes, full-tier
    reads, fetch overlap, tier occupancy) beside SGLang's."""
    worker = scheduler.draft_worker
    if hasattr(worker, "live_report"):
        result.internal_state["vericache_state"] = worker.live_report()
    return result


class _EngineServerArgs:
    """`Engine.server_args_class` that also accepts the `vericache_*` keyword arguments.

    Engine loads plugins inside its own `__init__`, so a hook on `__init__` would miss the first
    engine; the class attribute it reads afterwards to build the record is reached in time.
    """

    def __init__(self, server_args_class: type) -> None:
        self.server_args_class = server_args_class

    def __call__(self, **kwargs: Any) -> Any:
        config = VeriCacheConfig.build({name: kwargs.pop(name, None) for name in option_names()})
        server_args = self.server_args_class(**kwargs)
        attach_config(server_args, config)
        _configure(server_args)
        return server_args


ENGINE_ARGS_CLASS = internal("sglang.srt.entrypoints.engine.Engine", "server_args_class",
                             "class attribute", __name__)


def _accept_engine_kwargs() -> None:
    from sglang.srt.entrypoints.engine import Engine

    if not isinstance(Engine.__dict__.get(ENGINE_ARGS_CLASS.name), _EngineServerArgs):
        ENGINE_ARGS_CLASS.wrap(Engine, _EngineServerArgs)


def _cpu_engine() -> bool:
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"


def _default_device(server_args: Any) -> None:
    """With SGLang's CPU engine selected, an unset --device means cpu (SGLang would fail)."""
    if _cpu_engine() and server_args.device is None:
        server_args.device = "cpu"


def _configure(server_args: Any) -> None:
    """Set the SGLang arguments VeriCache's settings imply, before SGLang resolves them; stop
    with one line if a hook or another SGLang internal VeriCache needs is missing here."""
    _default_device(server_args)
    configure_spec(server_args)
    placement.resolve(server_args)
    disk.configure(server_args)
    config = get_config(server_args)
    if config.enable_vericache:
        stores.import_backend(server_args.hicache_storage_backend)
        found = hooks.problems()
        if found:
            raise startup.error(found[0])
        problem = check_early_drafting(server_args, config)
        if problem is not None:
            raise startup.error(problem)


def register() -> None:
    """Plugin entry point: register VeriCache's hooks with SGLang (a failure is recorded for
    the startup check, then raised for SGLang to log)."""
    try:
        _register()
    except Exception as error:
        hooks.registration_failed(error)
        raise


def _register() -> None:
    install_cpu_support()
    startup.register()
    if _cpu_engine():
        cpu_hicache.register()
        lazy_kv.register()
        softcap.register()
        moe_gate.register()
    register_spec()
    stores.register()
    meta_info.register()
    hook(f"{SERVER_ARGS}.add_cli_args", _add_cli_args, HookType.AROUND)
    hook(f"{SERVER_ARGS}.from_cli_args", _from_cli_args, HookType.AROUND)
    hook(f"{SERVER_ARGS}.resolved_dict", _resolved_dict, HookType.AFTER)
    hook("sglang.srt.managers.scheduler.Scheduler.get_init_info",
         _scheduler_init_info, HookType.AFTER)
    hook("sglang.srt.managers.scheduler.Scheduler.get_internal_state",
         _scheduler_internal_state, HookType.AFTER)
    hook(budget.TARGET, budget.fit_compressed_pool, HookType.AROUND)
    hook(budget.MAX_REQUESTS_TARGET, budget.cap_running_requests, HookType.AROUND)
    _accept_engine_kwargs()
