"""The gradient path: from a parameter's gradient to a chunk whose gradients are final."""
