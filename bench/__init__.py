"""Benchmarks and the HF transformers evaluation harness (not part of the installed package).

Run them from the repository root as modules, so that `vericache_tools.hf_eval` imports:
`python -m bench` runs every script as a suite into one report (docs/benchmarks.md), and
`python -m bench.X` runs one script with its own flags, e.g. `python -m bench.spec_decode --help`.
"""
