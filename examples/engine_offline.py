"""Offline inference with `sglang.Engine` and VeriCache's settings as keyword arguments.

Run after ./setup.sh:  .venv/bin/python examples/engine_offline.py
"""

import sglang

from vericache_sglang import models


def main() -> None:
    engine = sglang.Engine(
        model_path=str(models.prepare().target),
        max_total_tokens=8192,
        enable_vericache=True,
        vericache_compressor="kivi:bits=4,group=32",
        vericache_draft_length=16,
    )
    try:
        print("VeriCache settings:", engine.get_server_info()["vericache"])
        out = engine.generate("def quicksort(items):", {"temperature": 0, "max_new_tokens": 64})
        print(out["text"])
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
