"""KV tiers: the compressed tier on the device beside the full-precision tier."""
