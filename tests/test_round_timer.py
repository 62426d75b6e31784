"""`bench.round_host_time`'s timer loads in a server process as an SGLang plugin and wraps what
it times (the benchmark itself runs servers for minutes: not a test)."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.round_host_time import plugin_dir

CODE = """
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.model_executor.model_runner import ModelRunner
from vericache_sglang.speculative.worker import VeriCacheWorker
print(VeriCacheWorker.forward_batch_generation.__name__, ModelRunner.forward.__name__)
"""


def test_the_round_timer_is_an_sglang_plugin_wrapping_rounds_and_forwards(tmp_path):
    plugins = plugin_dir(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(plugins),
           "VERICACHE_ROUND_TIMER_OUT": str(tmp_path / "totals.json")}
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True,
                         check=True, timeout=300)
    assert out.stdout.split()[-2:] == ["timed_round", "timed_forward"]
