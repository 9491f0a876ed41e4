"""A JAX/Flax research framework for training decoder-only Transformers and comparing ablations."""
