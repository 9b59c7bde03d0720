"""Plans that must all train bitwise alike (Invariant 1), shared by the CPU and device tests."""

PLANS = {
    "all-device": dict(param_placement="device", optimizer_placement="device"),
    "host-params-min-cache": dict(
        param_placement="host", optimizer_placement="device", cache_blocks=2, chunk_size=5000
    ),
    "host-params-2x-cache": dict(
        param_placement="host", optimizer_placement="device", cache_blocks=4, chunk_size=5000
    ),
    "optimizer-on-host": dict(param_placement="device", optimizer_placement="host"),
    "all-host-prefetch0": dict(
        param_placement="host", optimizer_placement="host", cache_blocks=3, prefetch=0
    ),
    "all-host-prefetch2": dict(
        param_placement="host", optimizer_placement="host", cache_blocks=3, prefetch=2
    ),
    "chunk-4096": dict(
        chunk_size=4096, param_placement="host", optimizer_placement="host", cache_blocks=3
    ),
    "chunk-7777": dict(
        chunk_size=7777, param_placement="host", optimizer_placement="device", cache_blocks=2
    ),
    "chunk-12345": dict(chunk_size=12345),
    "auto-budget": dict(device_memory=200_000),
}
