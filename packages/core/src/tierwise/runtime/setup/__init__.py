"""Setup as a pipeline of stages (``pipeline.assemble_engine``): patterns, profiling, planning,
chunk_layout, allocation, values, bindings, engine_start."""
