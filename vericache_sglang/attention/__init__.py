"""Attention backends that read VeriCache tiers."""
