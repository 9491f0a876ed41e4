from transformer.model.transformer import Block, Transformer

__all__ = ["Block", "Transformer"]
