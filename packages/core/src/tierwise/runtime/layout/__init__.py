"""Chunk layout: packing parameters into chunks (setup) and re-packing them in the order the
first step recorded (the re-layout after warm-up)."""
