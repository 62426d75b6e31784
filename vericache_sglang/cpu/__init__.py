"""What SGLang needs to run on a machine without a GPU (see docs/cpu.md)."""
