"""Where a chunk's parameters are for compute: rCache blocks, fetch, evict, prefetch, loads in flight."""
