"""Shared test helpers: tiny HF models built offline and a multi-process (gloo) spawner."""
