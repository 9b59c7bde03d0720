"""Checkpoints: save and load by parameter name, manifest, reader."""
