"""Module access: the hooks, what they do, frozen modules, the warm-up trace."""
