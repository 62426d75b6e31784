"""Benchmarks and the HF transformers evaluation harness (not part of the installed package).

Run them from the repository root as modules, e.g. `python -m bench.spec_decode --help`, so that
`vericache_tools.hf_eval` imports.
"""
