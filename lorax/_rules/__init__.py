"""Low-rank rules, one module per primitive family; importing registers them."""

from . import conv, dot, gather, quant, ragged, sharding, structural, variants

__all__ = ["conv", "dot", "gather", "quant", "ragged", "sharding", "structural", "variants"]
