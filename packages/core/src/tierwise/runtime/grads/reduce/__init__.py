"""Reductions across data-parallel ranks in one agreed order."""
