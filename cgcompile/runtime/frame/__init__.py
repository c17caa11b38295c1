"""Wrappers at the level of a whole compiled frame or step: capture_sizes padding, FSDP2 keeping, Transformer
Engine's graphed callables, capture_step (the whole training step as one graph), verify."""
