"""lorax: LoRA for any JAX function."""

from ._adapter import load_adapter as load_adapter, save_adapter as save_adapter
from ._arith import add_weighted_adapter as add_weighted_adapter
from ._engine import (
    LoraMaterializationError as LoraMaterializationError,
    LoraMaterializationWarning as LoraMaterializationWarning,
)
from ._formats import (
    load_gguf as load_gguf,
    load_peft as load_peft,
    load_safetensors as load_safetensors,
    save_gguf_lora as save_gguf_lora,
    save_safetensors as save_safetensors,
    save_peft as save_peft,
)
from ._init import init_lora as init_lora
from ._layout import infer_layout as infer_layout
from ._optim import wrap_optimizer as wrap_optimizer
from ._quant import QuantizedArray as QuantizedArray, quantize as quantize
from ._offload import offload_frozen as offload_frozen, offload_state as offload_state
from ._params import (
    combine as combine,
    merge_params as merge_params,
    partition as partition,
    split_lora_params as split_lora_params,
)
from ._stack import (
    adapter_axes as adapter_axes,
    mixed_batch as mixed_batch,
    select_adapters as select_adapters,
    stack_adapters as stack_adapters,
    unstack_adapters as unstack_adapters,
)
from ._spec import (
    LORA_FREEZE as LORA_FREEZE,
    LORA_FULL as LORA_FULL,
    LoraSpec as LoraSpec,
    SpecSummary as SpecSummary,
    simple_spec as simple_spec,
    summary as summary,
)
from ._transform import lora as lora
from ._variants.dora import DoraWeight as DoraWeight
from ._variants.dropout import LoraDropout as LoraDropout, dropout as dropout
from ._variants.init import LoftQ as LoftQ
from ._variants.loraplus import loraplus as loraplus
from ._version import __version__ as __version__
from ._weight import LoraWeight as LoraWeight

__all__ = [
    "LORA_FREEZE",
    "LORA_FULL",
    "DoraWeight",
    "LoftQ",
    "LoraDropout",
    "LoraMaterializationError",
    "LoraMaterializationWarning",
    "LoraSpec",
    "LoraWeight",
    "QuantizedArray",
    "SpecSummary",
    "adapter_axes",
    "add_weighted_adapter",
    "combine",
    "dropout",
    "infer_layout",
    "init_lora",
    "load_adapter",
    "load_gguf",
    "load_peft",
    "load_safetensors",
    "lora",
    "loraplus",
    "merge_params",
    "mixed_batch",
    "offload_frozen",
    "offload_state",
    "partition",
    "quantize",
    "save_adapter",
    "save_gguf_lora",
    "save_safetensors",
    "save_peft",
    "select_adapters",
    "simple_spec",
    "split_lora_params",
    "stack_adapters",
    "summary",
    "unstack_adapters",
    "wrap_optimizer",
]
