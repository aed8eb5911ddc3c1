"""Reference PyTorch implementations of the preset model families, built from a ModelSpec.

Used to profile layers, by the examples, and by the tests of the runtime hooks. Weights are random;
nothing is downloaded.
"""

from dsauto.models.gpt import Block, Embedding, Head, ReferenceModel, build_model

__all__ = ["Block", "Embedding", "Head", "ReferenceModel", "build_model"]
