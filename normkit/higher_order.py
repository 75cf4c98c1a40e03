"""Backward passes that autograd can differentiate again: what every op's backward computes when
it runs with grad mode on (``torch.autograd.grad(..., create_graph=True)``, ``backward(create_graph=
True)``: gradient penalties, MAML, Hessian-vector products).

The kernels' backward is first-order only (its outputs have no autograd history), so with
``create_graph`` the ops recompute their forward from the saved inputs with differentiable torch ops
in the math dtype (fp32; fp64 for fp64 inputs) and take its gradient with ``create_graph=True``:
the result equals torch's to rounding, and autograd can differentiate it again to any order, also
with respect to the incoming gradient. Saved *outputs* (softmax's y, the add-norms' h) carry their
op's autograd history, so gradients through them reach the op's inputs by the chain rule.

Every function takes the tensors as the custom ops hold them (rows ``(M, N)``; images ``(N, C, HW)``)
and returns gradients in the dtypes of the tensors they belong to. Speed matters less here than on
the first-order path: these are plain torch ops, a few launches each.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _leaf(t: Optional[Tensor]) -> Optional[Tensor]:
    """``t`` where it already has autograd history (its gradient must reach what made it), else a
    detached copy that requires grad (the gradient w.r.t. it is still wanted)."""
    if t is None or t.requires_grad:
        return t
    return t.detach().requires_grad_()


def _bias_leaf(bias_dtype: Optional[torch.dtype], n: int, like: Tensor) -> Optional[Tensor]:
    """A stand-in for the bias: its gradient (the sum of dy) does not depend on its value."""
    if bias_dtype is None:
        return None
    return torch.zeros(n, dtype=bias_dtype, device=like.device, requires_grad=True)


def _grads(output: Tensor, grad: Tensor, inputs) -> list[Optional[Tensor]]:
    """d(output)/d(inputs) . grad with ``create_graph=True``; None for a None input, zeros where an
    input does not reach the output."""
    wanted = [t for t in inputs if t is not None]
    got = iter(torch.autograd.grad(output, wanted, grad, create_graph=True, allow_unused=True))
    result = []
    for t in inputs:
        if t is None:
            result.append(None)
            continue
        g = next(got)
        result.append(torch.zeros_like(t) if g is None else g)
    return result


def _affine(y: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], shape) -> Tensor:
    if weight is not None:
        y = y * weight.to(y.dtype).view(shape)
    if bias is not None:
        y = y + bias.to(y.dtype).view(shape)
    return y


def row_norm(dy: Tensor, x: Tensor, weight: Optional[Tensor], bias_dtype: Optional[torch.dtype], eps: float,
             is_rms: bool) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:  # fmt: skip
    """LayerNorm / RMSNorm of rows ``x`` (M, N) -> (dx, dweight, dbias)."""
    with torch.enable_grad():
        acc, n = _acc(x), x.shape[-1]
        xl, wl, bl = _leaf(x), _leaf(weight), _bias_leaf(bias_dtype, n, x)
        xm = xl.to(acc)
        y = F.rms_norm(xm, (n,), None, eps) if is_rms else F.layer_norm(xm, (n,), None, None, eps)
        y = _affine(y, wl, bl, (n,))
        dx, dw, db = _grads(y, dy.to(acc), (xl, wl, bl))
    return dx, dw, db


def add_norm(dy: Optional[Tensor], dh: Optional[Tensor], h: Tensor, weight: Optional[Tensor],
             bias_dtype: Optional[torch.dtype], eps: float, is_rms: bool, keep_scale: Optional[Tensor],
             x_dtype: torch.dtype, residual_dtype: Optional[torch.dtype]):  # fmt: skip
    """h = dropout(x) + residual, y = norm(h) -> (dx, dresidual, dweight, dbias). ``keep_scale``:
    the dropout mask times 1 / (1 - p) in fp32 as the backend drew it (None without dropout)."""
    acc = _acc(h)
    if dy is None:  # y unused: no gradient reaches the weight and bias (None, as torch gives)
        dh_norm, dw, db = torch.zeros_like(h, dtype=acc), None, None
    else:
        dh_norm, dw, db = row_norm(dy, h, weight, bias_dtype, eps, is_rms)
        dh_norm = dh_norm.to(acc)
    total = dh_norm if dh is None else dh_norm + dh.to(acc)
    dres = None if residual_dtype is None else total.to(residual_dtype)
    dx = total if keep_scale is None else total * keep_scale.to(acc)
    return dx.to(x_dtype), dres, dw, db


def softmax(dy: Tensor, y: Tensor, log: bool) -> Tensor:
    """softmax / log_softmax along the last dim, from its output ``y`` -> dx."""
    acc = _acc(y)
    d, ym = dy.to(acc), y.to(acc)
    if log:
        dx = d - ym.exp() * d.sum(-1, keepdim=True)
    else:
        dx = ym * (d - (d * ym).sum(-1, keepdim=True))
    return dx.to(y.dtype)


def group_norm(dy: Tensor, x: Tensor, weight: Optional[Tensor], bias_dtype: Optional[torch.dtype],
               num_groups: int, eps: float) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:  # fmt: skip
    """GroupNorm of ``x`` (N, C, HW) -> (dx, dweight, dbias)."""
    with torch.enable_grad():
        acc, c = _acc(x), x.shape[1]
        xl, wl, bl = _leaf(x), _leaf(weight), _bias_leaf(bias_dtype, c, x)
        y = _affine(F.group_norm(xl.to(acc), num_groups, None, None, eps), wl, bl, (1, c, 1))
        dx, dw, db = _grads(y, dy.to(acc), (xl, wl, bl))
    return dx, dw, db


def batch_norm(dy: Tensor, x: Tensor, weight: Optional[Tensor], bias_dtype: Optional[torch.dtype],
               mean: Tensor, rstd: Tensor, training: bool, eps: Optional[float]):  # fmt: skip
    """BatchNorm of ``x`` (N, C, HW) -> (dx, dweight, dbias). ``training``: this batch's statistics,
    recomputed from x (``eps`` needed); else ``mean`` / ``rstd`` are constants (running statistics)."""
    with torch.enable_grad():
        acc, c = _acc(x), x.shape[1]
        xl, wl, bl = _leaf(x), _leaf(weight), _bias_leaf(bias_dtype, c, x)
        xm = xl.to(acc)
        if training:
            if eps is None:
                raise RuntimeError("batch_norm: double backward of a training-mode call needs its eps; "
                                   "call normkit.batch_norm (the front end passes it)")  # fmt: skip
            y = F.batch_norm(xm, None, None, None, None, True, 0.0, eps)
        else:
            y = (xm - mean.detach().to(acc).view(1, c, 1)) * rstd.detach().to(acc).view(1, c, 1)
        y = _affine(y, wl, bl, (1, c, 1))
        dx, dw, db = _grads(y, dy.to(acc), (xl, wl, bl))
    return dx, dw, db
