"""The row-norm entry points of the backend contract, over a backend's own launchers.

Both Triton backends implement LayerNorm, RMSNorm and the fused add-norm with one ``_forward`` and
one ``_backward`` launcher each (their kernels differ); the eight contract functions only reorder
arguments, so they are built here once for both.
"""

from __future__ import annotations

from types import SimpleNamespace


def row_norm_contract(forward, backward) -> SimpleNamespace:
    """``forward(x, weight, bias, eps, is_rms, add, residual, h_dtype, dropout_p, seed)`` ->
    (y, h, mean, rstd); ``backward(dy, x, weight, mean, rstd, bias_dtype, is_rms, dh, x_dtype,
    residual_dtype, dropout_p, seed)`` -> (dx, dresidual, dweight, dbias)."""

    def layer_norm_fwd(x, weight, bias, eps):
        """x: (M, N) rows -> (y, mean, rstd); see docs/design.md for the contract."""
        y, _, mean, rstd = forward(x, weight, bias, eps, False)
        return y, mean, rstd

    def layer_norm_bwd(dy, x, weight, mean, rstd, bias_dtype):
        """-> (dx, dweight, dbias), None where the forward had no weight / bias."""
        dx, _, dweight, dbias = backward(dy, x, weight, mean, rstd, bias_dtype, False)
        return dx, dweight, dbias

    def rms_norm_fwd(x, weight, eps):
        """x: (M, N) rows -> (y, rstd)."""
        y, _, _, rstd = forward(x, weight, None, eps, True)
        return y, rstd

    def rms_norm_bwd(dy, x, weight, rstd):
        """-> (dx, dweight), dweight None when the forward had no weight."""
        dx, _, dweight, _ = backward(dy, x, weight, rstd, rstd, None, True)
        return dx, dweight

    def add_layer_norm_fwd(x, residual, weight, bias, eps, dropout_p, seed, h_dtype):
        """h = dropout(x) + residual (residual may be None) in h_dtype; -> (y, h, mean, rstd)."""
        return forward(x, weight, bias, eps, False, True, residual, h_dtype, dropout_p, seed)

    def add_layer_norm_bwd(dy, dh, h, weight, mean, rstd, bias_dtype, dropout_p, seed, x_dtype,
                           residual_dtype):  # fmt: skip
        """-> (dx, dresidual, dweight, dbias); dh (h's own incoming gradient) may be None."""
        return backward(dy, h, weight, mean, rstd, bias_dtype, False, dh, x_dtype, residual_dtype,
                        dropout_p, seed)  # fmt: skip

    def add_rms_norm_fwd(x, residual, weight, eps, dropout_p, seed, h_dtype):
        """-> (y, h, rstd)."""
        y, h, _, rstd = forward(x, weight, None, eps, True, True, residual, h_dtype, dropout_p, seed)
        return y, h, rstd

    def add_rms_norm_bwd(dy, dh, h, weight, rstd, dropout_p, seed, x_dtype, residual_dtype):
        """-> (dx, dresidual, dweight)."""
        dx, dres, dweight, _ = backward(dy, h, weight, rstd, rstd, None, True, dh, x_dtype,
                                        residual_dtype, dropout_p, seed)  # fmt: skip
        return dx, dres, dweight

    return SimpleNamespace(**{f.__name__: f for f in (
        layer_norm_fwd, layer_norm_bwd, rms_norm_fwd, rms_norm_bwd, add_layer_norm_fwd,
        add_layer_norm_bwd, add_rms_norm_fwd, add_rms_norm_bwd)})  # fmt: skip
