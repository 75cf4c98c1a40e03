"""Plain-PyTorch implementation of the backend contract: the CPU backend and the test oracle.

Every function takes 2-D row-major views ``(M, N)`` (the front end flattens leading and normalized
dims) and computes in fp32, or in fp64 for fp64 inputs; the tests call it on fp64 copies of the
inputs, which makes it the fp64 oracle. Statistics (mean, rstd) are returned in that math dtype.
"""

from __future__ import annotations

import torch

NAME = "reference"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _affine(xhat, weight, bias):
    if weight is not None:
        xhat = xhat * weight.to(xhat.dtype)
    if bias is not None:
        xhat = xhat + bias.to(xhat.dtype)
    return xhat


def _norm_fwd(x, weight, bias, eps, is_rms):
    """-> (y in the math dtype, mean or None, rstd)."""
    xf = x.to(_math_dtype(x))
    if is_rms:
        mean, xc = None, xf
    else:
        mean = xf.mean(dim=1)
        xc = xf - mean[:, None]
    # Two-pass variance (mean of centred squares): exact for large means, unlike E[x^2] - E[x]^2.
    rstd = torch.rsqrt((xc * xc).mean(dim=1) + eps)
    return _affine(xc * rstd[:, None], weight, bias), mean, rstd


def _norm_bwd(dy, x, weight, mean, rstd, bias_dtype):
    """-> (dx in the math dtype, dweight, dbias); mean None means RMSNorm."""
    acc = _math_dtype(x)
    dyf, r = dy.to(acc), rstd.to(acc)[:, None]
    xhat = (x.to(acc) if mean is None else x.to(acc) - mean.to(acc)[:, None]) * r
    wdy = dyf * weight.to(acc) if weight is not None else dyf
    dx = wdy - xhat * (xhat * wdy).mean(dim=1, keepdim=True)
    if mean is not None:
        dx = dx - wdy.mean(dim=1, keepdim=True)
    dweight = (dyf * xhat).sum(dim=0).to(weight.dtype) if weight is not None else None
    dbias = dyf.sum(dim=0).to(bias_dtype) if bias_dtype is not None else None
    return dx * r, dweight, dbias


def layer_norm_fwd(x, weight, bias, eps):
    """x: (M, N); weight, bias: (N,) or None -> (y (M, N) in x.dtype, mean (M,), rstd (M,))."""
    y, mean, rstd = _norm_fwd(x, weight, bias, eps, is_rms=False)
    return y.to(x.dtype), mean, rstd


def layer_norm_bwd(dy, x, weight, mean, rstd, bias_dtype):
    """-> (dx (M, N) in x.dtype, dweight in weight.dtype, dbias in bias_dtype); None where absent.

    ``bias_dtype`` is the bias's dtype, or None when the forward had no bias.
    """
    dx, dweight, dbias = _norm_bwd(dy, x, weight, mean, rstd, bias_dtype)
    return dx.to(x.dtype), dweight, dbias


def rms_norm_fwd(x, weight, eps):
    """x: (M, N); weight: (N,) or None -> (y (M, N) in x.dtype, rstd (M,))."""
    y, _, rstd = _norm_fwd(x, weight, None, eps, is_rms=True)
    return y.to(x.dtype), rstd


def rms_norm_bwd(dy, x, weight, rstd):
    """-> (dx (M, N) in x.dtype, dweight in weight.dtype or None)."""
    dx, dweight, _ = _norm_bwd(dy, x, weight, None, rstd, None)
    return dx.to(x.dtype), dweight


def dropout_keep(shape, dropout_p, seed, device):
    """The reference backend's dropout mask: the hash every kernel draws (normkit.rng, docs/numerics.md),
    a function of (seed, shape) alone, so the backward regenerates the forward's mask."""
    from normkit import rng

    return rng.keep_mask(shape, dropout_p, seed, device)


def _residual_in(x, residual, dropout_p, seed, h_dtype):
    h = x.to(_math_dtype(x))
    if dropout_p > 0:
        keep = dropout_keep(x.shape, dropout_p, seed, x.device)
        h = torch.where(keep, h * (1.0 / (1.0 - dropout_p)), 0.0)
    if residual is not None:
        h = h + residual.to(h.dtype)
    return h.to(h_dtype)


def _residual_grad(dh_norm, dh, dropout_p, seed, x_dtype, residual_dtype):
    dh_total = dh_norm if dh is None else dh_norm + dh.to(dh_norm.dtype)
    dres = dh_total.to(residual_dtype) if residual_dtype is not None else None
    dx = dh_total
    if dropout_p > 0:
        keep = dropout_keep(dx.shape, dropout_p, seed, dx.device)
        dx = torch.where(keep, dx * (1.0 / (1.0 - dropout_p)), 0.0)
    return dx.to(x_dtype), dres


def add_layer_norm_fwd(x, residual, weight, bias, eps, dropout_p, seed, h_dtype):
    """h = dropout(x) + residual (residual may be None), stored in h_dtype; y = layer_norm(h) in
    x.dtype. -> (y, h, mean, rstd)."""
    h = _residual_in(x, residual, dropout_p, seed, h_dtype)
    y, mean, rstd = _norm_fwd(h, weight, bias, eps, is_rms=False)
    return y.to(x.dtype), h, mean, rstd


def add_layer_norm_bwd(dy, dh, h, weight, mean, rstd, bias_dtype, dropout_p, seed, x_dtype,
                       residual_dtype):  # fmt: skip
    """dh: h's own incoming gradient or None; residual_dtype None when there was no residual.
    -> (dx in x_dtype, dresidual in residual_dtype or None, dweight, dbias)."""
    dh_norm, dweight, dbias = _norm_bwd(dy, h, weight, mean, rstd, bias_dtype)
    dx, dres = _residual_grad(dh_norm, dh, dropout_p, seed, x_dtype, residual_dtype)
    return dx, dres, dweight, dbias


def add_rms_norm_fwd(x, residual, weight, eps, dropout_p, seed, h_dtype):
    """-> (y, h, rstd); see add_layer_norm_fwd."""
    h = _residual_in(x, residual, dropout_p, seed, h_dtype)
    y, _, rstd = _norm_fwd(h, weight, None, eps, is_rms=True)
    return y.to(x.dtype), h, rstd


def add_rms_norm_bwd(dy, dh, h, weight, rstd, dropout_p, seed, x_dtype, residual_dtype):
    """-> (dx, dresidual or None, dweight or None); see add_layer_norm_bwd."""
    dh_norm, dweight, _ = _norm_bwd(dy, h, weight, None, rstd, None)
    dx, dres = _residual_grad(dh_norm, dh, dropout_p, seed, x_dtype, residual_dtype)
    return dx, dres, dweight


def _in_layout(t, like):
    """``t`` (contiguous) in ``like``'s strides: the channel norms' outputs keep a channels-last
    input's layout, as the Triton backends write them."""
    return t if like.is_contiguous() else torch.empty_like(like, dtype=t.dtype).copy_(t)


def group_norm_fwd(x, weight, bias, num_groups, eps):
    """x: (N, C, HW), contiguous or channels-last -> (y in x.dtype and x's layout, mean (N * G,),
    rstd (N * G,)); per-channel affine."""
    N, C, HW = x.shape
    rows = x.reshape(N * num_groups, C // num_groups * HW)
    y, mean, rstd = _norm_fwd(rows, None, None, eps, is_rms=False)
    y = y.reshape(N, C, HW)
    if weight is not None:
        y = y * weight.to(y.dtype)[None, :, None]
    if bias is not None:
        y = y + bias.to(y.dtype)[None, :, None]
    return _in_layout(y.to(x.dtype), x), mean, rstd


def group_norm_bwd(dy, x, weight, mean, rstd, num_groups, bias_dtype):
    """-> (dx in x.dtype, dweight in weight.dtype or None, dbias in bias_dtype or None)."""
    N, C, HW = x.shape
    acc = _math_dtype(x)
    rows = x.reshape(N * num_groups, C // num_groups * HW)
    dyf = dy.to(acc)
    xhat = ((rows.to(acc) - mean.to(acc)[:, None]) * rstd.to(acc)[:, None]).reshape(N, C, HW)
    dweight = (dyf * xhat).sum(dim=(0, 2)).to(weight.dtype) if weight is not None else None
    dbias = dyf.sum(dim=(0, 2)).to(bias_dtype) if bias_dtype is not None else None
    wdy = dyf * weight.to(acc)[None, :, None] if weight is not None else dyf
    dx, _, _ = _norm_bwd(wdy.reshape(rows.shape), rows, None, mean, rstd, None)
    return _in_layout(dx.reshape(N, C, HW).to(x.dtype), x), dweight, dbias


def batch_norm_stats(x, eps, momentum=0.0, running_mean=None, running_var=None):
    """x: (N, C, HW) -> (mean, rstd = 1 / sqrt(biased var + eps)) per channel, (C,) in the math dtype
    (two-pass). ``running_mean`` / ``running_var``, when given, are updated in place
    (:func:`update_running_stats`)."""
    xf = x.to(_math_dtype(x))
    mean = xf.mean(dim=(0, 2))
    var = (xf - mean[None, :, None]).square().mean(dim=(0, 2))
    update_running_stats(mean, var, x.shape[0] * x.shape[2], momentum, running_mean, running_var)
    return mean, torch.rsqrt(var + eps)


def update_running_stats(mean, var, count, momentum, running_mean, running_var):
    """As torch's BatchNorm: running = (1 - momentum) * running + momentum * batch statistic, the
    unbiased variance (x count / (count - 1)) for ``running_var``; in the running tensors' dtype.
    ``count`` > 1 values per channel (the front end refuses fewer and passes None for none)."""
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = (var * (count / (count - 1))).to(running_var.dtype)
            running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)


def batch_norm_apply(x, weight, bias, mean, rstd):
    """y = (x - mean_c) * rstd_c * weight_c + bias_c, in x.dtype."""
    acc = _math_dtype(x)
    y = (x.to(acc) - mean.to(acc)[None, :, None]) * rstd.to(acc)[None, :, None]
    if weight is not None:
        y = y * weight.to(acc)[None, :, None]
    if bias is not None:
        y = y + bias.to(acc)[None, :, None]
    return y.to(x.dtype)


def train_fwd_from(stats, apply):
    """``batch_norm_train_fwd`` over a backend's ``batch_norm_stats`` (which updates the running
    statistics it is given in place: copies, unless ``in_place``) and ``batch_norm_apply``: the
    reference's, the NPU backend's, and the CUDA backend's where it cannot split channels.

    The contract's training forward is functional by default: the updated running statistics come
    back as new tensors (the traced operator's front end copies them into the module's buffers), so
    one custom operator with an autograd formula serves the whole training forward (and a backend
    can read x once); eager calls pass ``in_place=True`` and skip the copies (~25-30 us of host time
    a call on the H100 host, docs/tuning-log.md T19)."""

    def batch_norm_train_fwd(x, weight, bias, eps, momentum, running_mean, running_var, in_place=False):
        """x: (N, C, HW) contiguous -> (y, mean, rstd, running_mean', running_var'): this batch's
        statistics, and the running statistics after this step (None where not given): new
        tensors, or ``running_mean`` / ``running_var`` themselves updated when ``in_place``."""
        rm = running_mean if in_place or running_mean is None else running_mean.clone()
        rv = running_var if in_place or running_var is None else running_var.clone()
        mean, rstd = stats(x, eps, momentum, rm, rv)
        return apply(x, weight, bias, mean, rstd), mean, rstd, rm, rv

    return batch_norm_train_fwd


batch_norm_train_fwd = train_fwd_from(batch_norm_stats, batch_norm_apply)


def batch_norm_bwd(dy, x, weight, mean, rstd, training, bias_dtype):
    """-> (dx, dweight, dbias). ``training``: mean/rstd were this batch's statistics, so their
    gradient flows to x; otherwise they were running statistics (constants)."""
    acc = _math_dtype(x)
    dyf, r = dy.to(acc), rstd.to(acc)[None, :, None]
    xhat = (x.to(acc) - mean.to(acc)[None, :, None]) * r
    sum_dy, sum_dy_xhat = dyf.sum(dim=(0, 2)), (dyf * xhat).sum(dim=(0, 2))
    scale = r * weight.to(acc)[None, :, None] if weight is not None else r
    if training:
        count = x.shape[0] * x.shape[2]
        dyf = dyf - (sum_dy[None, :, None] + xhat * sum_dy_xhat[None, :, None]) / count
    dweight = sum_dy_xhat.to(weight.dtype) if weight is not None else None
    dbias = sum_dy.to(bias_dtype) if bias_dtype is not None else None
    return (dyf * scale).to(x.dtype), dweight, dbias


def softmax_fwd(x, log):
    """x: (M, N) -> softmax (or log_softmax when ``log``) along each row, in x.dtype.

    Rows whose entries are all -inf give NaN, as torch does.
    """
    xf = x.to(_math_dtype(x))
    y = torch.log_softmax(xf, dim=1) if log else torch.softmax(xf, dim=1)
    return y.to(x.dtype)


def softmax_bwd(dy, y, log):
    """dy, y: (M, N) (y = the forward's output) -> dx in y.dtype."""
    acc = _math_dtype(y)
    dyf, yf = dy.to(acc), y.to(acc)
    if log:
        dx = dyf - torch.exp(yf) * dyf.sum(dim=1, keepdim=True)
    else:
        dx = yf * (dyf - (dyf * yf).sum(dim=1, keepdim=True))
    return dx.to(y.dtype)
