"""Core's default planner and the planning arithmetic it shares with plugins."""
