"""Pretrained weights in and out of chunks without holding the model in host memory:
weight sources for ``setup(weights=...)`` and streaming safetensors shards."""

from tierwise.weights.safetensors_io import (
    READS,
    SafetensorsFile,
    SafetensorsWriter,
    ShardedWriter,
    WeightsError,
)
from tierwise.weights.source import (
    CallableWeights,
    DirectoryWeights,
    ResolvedWeights,
    WeightSource,
    open_weights,
)

__all__ = [
    "READS",
    "CallableWeights",
    "DirectoryWeights",
    "ResolvedWeights",
    "SafetensorsFile",
    "SafetensorsWriter",
    "ShardedWriter",
    "WeightSource",
    "WeightsError",
    "open_weights",
]
