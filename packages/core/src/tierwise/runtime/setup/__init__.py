"""Setup as a pipeline of stages, and the re-layout after warm-up."""
