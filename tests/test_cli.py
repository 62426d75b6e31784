"""`python -m sglang.launch_server` shows VeriCache's flags and refuses bad values at startup
with one readable line and exit status 1, whether the launcher finds them (flags) or the
scheduler does (a device budget too small for what VeriCache must keep on the device).

One launch per place an error is found (VeriCache's settings, SGLang settings VeriCache cannot
honour, the disk tier's storage, the scheduler's device budget, a model whose attention VeriCache
cannot serve exactly): each refused value is checked in-process by tests/test_config.py. They
all start at once, forked from the tests' launcher (`vericache_tools/forked_launch.py`, which
saves ~10 s of imports a launch, ~20 s where the scheduler starts), but the launcher with a
hook more, which starts from a shell; `--help` is a user's shell launch too."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.families import build

# Real launchers, stopped at startup or serving.
pytestmark = [pytest.mark.server, pytest.mark.usefixtures("no_idle_servers")]

MISSING_TARGET = "sglang.srt.managers.scheduler.Scheduler.renamed_by_an_upgrade"
"""A hook target SGLang does not have, as after an upgrade renamed one VeriCache hooks."""

HOOK_MISSING = f"""
import runpy, sys
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from vericache_sglang.integration import hooks

load_plugins()
hooks.hook("{MISSING_TARGET}", lambda original, *a, **k: original(*a, **k), HookType.AROUND)
HookRegistry.apply_hooks()
sys.argv[0] = "sglang.launch_server"
runpy.run_module("sglang.launch_server", run_name="__main__")
"""
"""The real launcher, in a process whose plugin has one hook more, on a missing target."""

BAD_FLAGS = {
    "unknown compressor": (["--enable-vericache", "--vericache-compressor", "zip:level=3"],
                           "zip"),
    "disk tier on another store": (["--enable-vericache", "--vericache-full-tier", "disk",
                                    "--hicache-storage-backend", "mooncake"],
                                   "stores pages in files"),
    "options without enable": (["--vericache-draft-length", "8"], "--enable-vericache"),
    "early drafting without a store": (["--enable-vericache", "--vericache-early-drafting"],
                                       "--vericache-early-drafting needs a Mooncake store"),
    "speculative flags VeriCache sets": (["--enable-vericache",
                                          "--speculative-num-draft-tokens", "8"],
                                         "--speculative-num-draft-tokens cannot be combined"),
    "device budget too small": (["--enable-vericache", "--vericache-full-tier", "host",
                                 "--max-total-tokens", "1000"], "raise --max-total-tokens"),
    "hook on a function SGLang lacks": (["--enable-vericache"],
                                        f"has no {MISSING_TARGET} to hook"),
    # DeepSeek's multi-head latent attention: no compressed latent KV yet (plain SGLang's CPU
    # engine cannot prefill MLA either: torch_native's MLA extend fails on a shape).
    "multi-head latent attention": (["--enable-vericache"],
                                    "DeepseekV2ForCausalLM has multi-head latent attention "
                                    "(MLA: DeepSeek V2/V3, Kimi K2); its compressed latent KV "
                                    "is not built yet: VeriCache cannot serve it exactly"),
}
MODEL_FAMILY = {"multi-head latent attention": "deepseek-v2"}
"""Cases launched on a tiny model of another family (`tests/support/families.py`)."""



FROM_A_SHELL = {"hook on a function SGLang lacks": ["-c", HOOK_MISSING]}
"""Cases launched by `python` itself, and how; the rest are forked."""


@pytest.fixture(scope="module")
def bad_launches(demo_model, forked_launcher, tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Start every bad launch at once, then collect each one's status and output (its errors
    and output in one log, as a forked launch writes them)."""
    models = {name: build(family, demo_model) for name, family in MODEL_FAMILY.items()}
    logs = tmp_path_factory.mktemp("bad_launches")
    procs = {}
    for name, (args, _) in BAD_FLAGS.items():
        argv = ["--model-path", str(models.get(name, demo_model)), "--port", "1", *args]
        log = logs / f"{len(procs)}.log"
        if name in FROM_A_SHELL:
            with log.open("w") as out:
                proc = subprocess.Popen([sys.executable, *FROM_A_SHELL[name], *argv],
                                        stdout=out, stderr=subprocess.STDOUT)
        else:
            proc = forked_launcher.start(argv, dict(os.environ), log)
        procs[name] = (proc, log)
    results = {}
    for name, (proc, log) in procs.items():
        results[name] = (proc.wait(timeout=300), log.read_text())
    return results


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_bad_flag_fails_with_one_line(bad_launches, case):
    returncode, output = bad_launches[case]
    assert returncode == 1, output[-2000:]
    if case == "hook on a function SGLang lacks":
        # SGLang's HookRegistry logs its own traceback for the target, then goes on.
        assert f"Failed to apply hooks to {MISSING_TARGET}" in output
    else:
        assert "Traceback" not in output
    errors = [line for line in output.splitlines() if line.startswith("vericache: error:")]
    assert len(errors) == 1, output
    assert BAD_FLAGS[case][1] in errors[0]
    assert output.rstrip().splitlines()[-1] == errors[0]


def test_help_lists_vericache_flags():
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0
    for flag in ("--enable-vericache", "--vericache-compressor", "--vericache-draft-length",
                 "--vericache-max-draft-length", "--vericache-full-tier",
                 "--vericache-full-tier-budget", "--vericache-staging-budget",
                 "--vericache-disk-dir", "--vericache-early-drafting",
                 "--vericache-drafting-deadline"):
        assert flag in out.stdout
    assert "VeriCache" in out.stdout
