"""Low-rank rules, one module per primitive family; importing registers them."""

from . import conv, dot, gather, permuted, quant, ragged, sharding, structural, variants

__all__ = ["conv", "dot", "gather", "permuted", "quant", "ragged", "sharding", "structural",
           "variants"]
