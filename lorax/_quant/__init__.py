"""A quantized frozen base: `QuantizedArray`, its formats, and `quantize`.

The rules that read a `QuantizedArray` live in `lorax/_rules/quant.py`.
"""

from ._array import QuantizedArray
from ._formats import FORMATS
from ._quantize import quantize

__all__ = ["FORMATS", "QuantizedArray", "quantize"]
