"""`tierwise train`: train or fine-tune a causal LM end to end with tierwise (the main job).

Modules: options (what the user asked), presets (models), data (corpus, tokenisers, batches),
schedule (learning rate), metrics (metrics.jsonl), trace and plot (memory.png), checkpoints
(atomic save and exact resume), report (console output), distributed (torchrun), run (the loop),
cli (argparse).
"""
