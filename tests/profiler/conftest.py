"""Profiler tests never touch the user's cache: the root conftest points TIERWISE_CACHE_DIR at a
temp dir for every test."""
