"""`conv_general_dilated` with a `LoraWeight` kernel: a conv with the input-side factor
(the rank `k` as its output features), then a 1x1 conv with the output-side factor.

Works for 1-D/2-D/3-D convs, any `dimension_numbers`, strides, padding and
dilation, because the first conv reuses every parameter of the original and the
second is pointwise. It needs the kernel's output-feature axis to be the whole of
one factor group (`HWIO` kernels factor as `H*W*I -> k -> O`, `OIHW` kernels as
`O <- k <- I*H*W`); grouped convs are materialized under the policy.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from .. import _engine
from .._placement import read_frozen
from .._weight import LoraWeight
from .dot import scale


@_engine.register(lax.conv_general_dilated_p)
def _(lhs: ArrayLike, rhs: LoraWeight, *, dimension_numbers: lax.ConvDimensionNumbers,
      feature_group_count: int, batch_group_count: int, **params: Any) -> Any:
    out = lora_conv(lhs, rhs, None, dimension_numbers, feature_group_count, batch_group_count,
                    params)
    if out is not None:
        return out
    return _engine.materialize_fallback(
        lax.conv_general_dilated_p, [lhs, rhs],
        dict(dimension_numbers=dimension_numbers, feature_group_count=feature_group_count,
             batch_group_count=batch_group_count, **params),
    )


def lora_conv(lhs: Any, rhs: LoraWeight, lhs_low: Any, dn: lax.ConvDimensionNumbers,
              feature_group_count: int, batch_group_count: int, params: dict,
              gate: Any = None) -> Any:
    """`conv(lhs, W) + s * pointwise(conv(lhs_low, F_in) * gate, F_out)`, or `None` when
    the kernel's factorisation does not fit (`lhs_low`: the low-rank path's input, `lhs`
    when `None`; `gate`: a mixed batch's `(k,)` rank gate, or `None`)."""
    nb, nm, nn = rhs.structure
    out_axis = dn.rhs_spec[0]
    if rhs.contiguous and nb == 0 and feature_group_count == 1 and batch_group_count == 1:
        if nn == 1 and out_axis == rhs.ndim - 1:
            f_in, f_out = rhs.b, jnp.swapaxes(rhs.a, 0, 1)  # (..., k), (O, k)
        elif nm == 1 and out_axis == 0:
            f_in, f_out = rhs.a, rhs.b  # (k, ...), (O, k)
        else:
            f_in = None
        if f_in is not None:
            w = rhs.w
            conv = lambda x, kernel, **p: lax.conv_general_dilated_p.bind(  # noqa: E731
                x, kernel, dimension_numbers=dn, feature_group_count=1,
                batch_group_count=1, **p,
            )
            # `w` is frozen already (see `lora`); a host-resident one is read on the device.
            base = read_frozen(lambda w, x: _engine.call(conv, x, w, **params), w, lhs)
            t = conv(lhs if lhs_low is None else lhs_low, f_in.astype(w.dtype), **params)
            t = scale(t, rhs.scale)
            if gate is not None:  # the rank is t's feature axis
                shape = [1] * t.ndim
                shape[dn.out_spec[1]] = gate.shape[-1]
                t = t * gate.reshape(shape).astype(t.dtype)
            # The 1x1 kernel in the caller's rhs layout: O and I=k, unit window.
            n_spatial = len(dn.rhs_spec) - 2
            kernel_shape = [1] * rhs.ndim
            kernel_shape[dn.rhs_spec[0]] = f_out.shape[0]
            kernel_shape[dn.rhs_spec[1]] = f_out.shape[1]
            o_first = dn.rhs_spec[0] < dn.rhs_spec[1]
            # `t` is in the caller's preferred_element_type when one is given (conv,
            # unlike dot_general, needs both operands in one dtype).
            kernel = (f_out if o_first else f_out.T).astype(t.dtype).reshape(kernel_shape)
            pointwise = dict(params)
            pointwise.update(
                window_strides=(1,) * n_spatial, padding=((0, 0),) * n_spatial,
                lhs_dilation=(1,) * n_spatial, rhs_dilation=(1,) * n_spatial,
            )
            point_dn = lax.ConvDimensionNumbers(dn.out_spec, dn.rhs_spec, dn.out_spec)
            low = lax.conv_general_dilated_p.bind(
                t, kernel, dimension_numbers=point_dn, feature_group_count=1,
                batch_group_count=1, **pointwise,
            )
            return base + low
    return None
