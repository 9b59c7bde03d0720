"""Saved activations per block: keep, recompute or swap."""
