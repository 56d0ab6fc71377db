"""BackPACK module extensions that ggnchunk supplies where BackPACK has none (or a bug)."""

from ggnchunk._layers.embedding import EmbeddingDiagGGN
from ggnchunk._layers.fallback import AutogradJacobian

__all__ = ["AutogradJacobian", "EmbeddingDiagGGN"]
