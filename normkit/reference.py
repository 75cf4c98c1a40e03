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


def layer_norm_fwd(x, weight, bias, eps):
    """x: (M, N); weight, bias: (N,) or None -> (y (M, N) in x.dtype, mean (M,), rstd (M,))."""
    xf = x.to(_math_dtype(x))
    mean = xf.mean(dim=1)
    xc = xf - mean[:, None]
    # Two-pass variance (mean of centred squares): exact for large means, unlike E[x^2] - E[x]^2.
    rstd = torch.rsqrt((xc * xc).mean(dim=1) + eps)
    y = _affine(xc * rstd[:, None], weight, bias)
    return y.to(x.dtype), mean, rstd


def layer_norm_bwd(dy, x, weight, mean, rstd, bias_dtype):
    """-> (dx (M, N) in x.dtype, dweight in weight.dtype, dbias in bias_dtype); None where absent.

    ``bias_dtype`` is the bias's dtype, or None when the forward had no bias.
    """
    acc = _math_dtype(x)
    dyf = dy.to(acc)
    xhat = (x.to(acc) - mean.to(acc)[:, None]) * rstd.to(acc)[:, None]
    wdy = dyf * weight.to(acc) if weight is not None else dyf
    c1 = (xhat * wdy).mean(dim=1, keepdim=True)
    c2 = wdy.mean(dim=1, keepdim=True)
    dx = (wdy - (xhat * c1 + c2)) * rstd.to(acc)[:, None]
    dweight = (dyf * xhat).sum(dim=0).to(weight.dtype) if weight is not None else None
    dbias = dyf.sum(dim=0).to(bias_dtype) if bias_dtype is not None else None
    return dx.to(x.dtype), dweight, dbias


def rms_norm_fwd(x, weight, eps):
    """x: (M, N); weight: (N,) or None -> (y (M, N) in x.dtype, rstd (M,))."""
    xf = x.to(_math_dtype(x))
    rstd = torch.rsqrt((xf * xf).mean(dim=1) + eps)
    y = _affine(xf * rstd[:, None], weight, None)
    return y.to(x.dtype), rstd


def rms_norm_bwd(dy, x, weight, rstd):
    """-> (dx (M, N) in x.dtype, dweight in weight.dtype or None)."""
    acc = _math_dtype(x)
    dyf = dy.to(acc)
    xhat = x.to(acc) * rstd.to(acc)[:, None]
    wdy = dyf * weight.to(acc) if weight is not None else dyf
    c1 = (xhat * wdy).mean(dim=1, keepdim=True)
    dx = (wdy - xhat * c1) * rstd.to(acc)[:, None]
    dweight = (dyf * xhat).sum(dim=0).to(weight.dtype) if weight is not None else None
    return dx.to(x.dtype), dweight


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
