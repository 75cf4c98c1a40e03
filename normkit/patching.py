"""Run an existing model's norm modules on normkit, in place: :func:`patch` and :func:`unpatch`.

How: every recognised module keeps its identity and only its ``__class__`` changes, to a subclass of
its class whose computing method calls normkit (``normkit.nn.LayerNorm`` etc. for exact torch.nn
classes; a subclass made here, once per class, otherwise). Nothing else is touched, so parameters
(the same Parameter objects: optimizers keep working), buffers, ``state_dict`` keys, device, dtype,
hooks, tied or shared modules, references held elsewhere and the root module itself all stay as
they were. Replacing child modules instead would need every attribute copied over and would miss
hooks and other references to the old object. :func:`unpatch` puts the original class back (kept
on the instance), so it is exact. Patched models pickle and deepcopy as patched models.

Recognised (each family behind a flag of :func:`patch`):

- ``torch.nn`` LayerNorm, RMSNorm, GroupNorm, BatchNorm1d/2d/3d, InstanceNorm1d/2d/3d, and their
  subclasses that do not override the computing method.
- Hugging Face transformers RMSNorm modules (``hf``): a class named ``*RMSNorm`` whose ``forward``
  (and ``_norm`` helper) has the source of one of the known forms below, compared as syntax trees
  (docstrings, comments, annotations and local names ignored), with a 1-D ``weight`` and a numeric
  eps attribute. The source, not the name, decides: classes with the same name pattern differ
  (weight applied before the norm, grouped norms, ``with_scale`` switches), and those are skipped.

  - Llama form (LlamaRMSNorm, Qwen2/3, Mistral and ~140 copies):
    ``weight * (x_fp32 * rstd).to(x.dtype)``, result in the promoted dtype. When the weight's dtype
    does not widen x's (the usual bf16 model), normkit computes ``x * rstd * weight`` in fp32 and
    rounds once, where HF rounds twice (the normalized x to x's dtype, then the product): outputs
    differ by at most about one ulp of x's dtype. Otherwise (fp32 weight, bf16 x: an fp32 result)
    it is ``weight * normkit.rms_norm(x)``, HF's own order.
  - Cast-after form (GptOss, Helium, ...): ``(weight * x_fp32 * rstd).to(x.dtype)``: normkit's
    single rounding, the same order.
  - Gemma form (Gemma, Gemma2/3, ...): ``(x_fp32 * rstd * (1 + weight.float())).type_as(x)``:
    ``normkit.rms_norm(x, weight=1 + weight.float())``, the same fp32 math and single rounding.

  HF computes fp64 inputs in fp32; normkit in fp64.

Modules of an enabled family that are not patched are listed in ``report.skipped`` with the reason
(overridden forward, wrapped forward, unknown source, SyncBatchNorm, uninitialised lazy modules).
The module is ``normkit.patching`` (``normkit.patch`` is the function).
"""

from __future__ import annotations

import ast
import inspect
import numbers
import textwrap
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.lazy import LazyModuleMixin

from normkit import distributed as F  # normkit.functional's ops, also on DTensors
from normkit import nn as nkn

__all__ = ["patch", "unpatch", "PatchReport", "Patched", "Skipped"]

_ORIGINAL = "_normkit_original_class"  # instance attribute: the class to restore


class Patched(NamedTuple):
    name: str  # qualified module name ("" for the root module)
    old: type
    new: type


class Skipped(NamedTuple):
    name: str
    cls: type
    reason: str


@dataclass
class PatchReport:
    """What :func:`patch` / :func:`unpatch` changed (iterates over ``patched``) and what it left."""

    patched: list[Patched] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def __iter__(self) -> Iterator[Patched]:
        return iter(self.patched)

    def __len__(self) -> int:
        return len(self.patched)

    def __str__(self) -> str:
        lines = [f"{p.name or '<root>'}: {_qualname(p.old)} -> {_qualname(p.new)}" for p in self.patched]
        lines += [f"{s.name or '<root>'}: {_qualname(s.cls)} skipped ({s.reason})" for s in self.skipped]
        return "\n".join(lines) or "nothing to patch"


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# --- Hugging Face RMSNorm forms ------------------------------------------------------------------------


def _rms_weight_after_cast(self, x):
    """Llama form: weight * normalized x rounded to x's dtype."""
    eps, w = getattr(self, self._normkit_eps_attr), self.weight
    if torch.promote_types(w.dtype, x.dtype) == x.dtype:
        return F.rms_norm(x, x.shape[-1:], w, eps)
    return w * F.rms_norm(x, x.shape[-1:], None, eps)


def _rms_weight_before_cast(self, x):
    """Cast-after form: (weight * normalized x) rounded once to x's dtype."""
    return F.rms_norm(x, x.shape[-1:], self.weight, getattr(self, self._normkit_eps_attr))


def _rms_one_plus_weight(self, x):
    """Gemma form: normalized x * (1 + weight) in fp32, rounded once to x's dtype."""
    return F.rms_norm(x, x.shape[-1:], 1.0 + self.weight.float(), getattr(self, self._normkit_eps_attr))


_LLAMA = """
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""
_LLAMA_RETURN = "return self.weight * hidden_states.to(input_dtype)"
_CAST_AFTER = _LLAMA.replace(_LLAMA_RETURN, "return (self.weight * hidden_states).to(input_dtype)")
_CAST_AFTER_FP32_WEIGHT = _LLAMA.replace(
    _LLAMA_RETURN, "return (self.weight.to(torch.float32) * hidden_states).to(input_dtype)"
)
_GEMMA = """
def forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)
"""
_GEMMA_NORM = """
def _norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
"""

# name -> (forward source, _norm source or None, normkit forward, eps attribute)
_HF_FORMS = {
    "llama": (_LLAMA, None, _rms_weight_after_cast, "variance_epsilon"),
    "cast-after": (_CAST_AFTER, None, _rms_weight_before_cast, "variance_epsilon"),
    "cast-after-fp32-weight": (_CAST_AFTER_FP32_WEIGHT, None, _rms_weight_before_cast, "variance_epsilon"),
    "gemma": (_GEMMA, _GEMMA_NORM, _rms_one_plus_weight, "eps"),
}


def _canonical(source: str) -> str:
    """A function's syntax tree without docstring, annotations and decorators, with its arguments
    and local variables renamed by order of appearance: equal for sources that differ only there."""
    fn = ast.parse(textwrap.dedent(source)).body[0]
    if not isinstance(fn, ast.FunctionDef):
        raise TypeError(f"expected a function definition, got {type(fn).__name__}")
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    fn.body, fn.decorator_list, fn.returns = body or [ast.Pass()], [], None
    names: dict[str, str] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.arg):
            node.annotation = None
            node.arg = names.setdefault(node.arg, f"v{len(names)}")
    local = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and (node.id in names or node.id in local):
            node.id = names.setdefault(node.id, f"v{len(names)}")
    return ast.dump(fn, annotate_fields=False, include_attributes=False)


_KNOWN_FORMS: dict[tuple[str, str | None], str] = {}  # canonical sources -> form name (filled lazily)
_HF_KIND: dict[type, tuple[str | None, str]] = {}  # class -> (kind or None, reason when None)


def _method_source(cls: type, name: str) -> str:
    """Canonical source of ``cls.name``; ValueError when it is wrapped or has no source."""
    fn = getattr(cls, name)
    if hasattr(fn, "__wrapped__"):
        raise ValueError(f"{name} is wrapped by a decorator")
    try:
        return _canonical(inspect.getsource(fn))
    except (OSError, TypeError, SyntaxError) as e:
        raise ValueError(f"the source of {name} is unavailable ({e})") from e


def _hf_kind(cls: type) -> tuple[str | None, str]:
    """("hf:<form>", "") for a class implementing one of ``_HF_FORMS``, else (None, why); cached."""
    if cls not in _HF_KIND:
        if not _KNOWN_FORMS:
            _KNOWN_FORMS.update({(_canonical(f), h and _canonical(h)): name
                                 for name, (f, h, _, _) in _HF_FORMS.items()})  # fmt: skip
        try:
            forward = _method_source(cls, "forward")
            uses_helper = "'_norm'" in forward and hasattr(cls, "_norm")
            helper = _method_source(cls, "_norm") if uses_helper else None
        except ValueError as e:
            _HF_KIND[cls] = None, str(e)
        else:
            form = _KNOWN_FORMS.get((forward, helper))
            _HF_KIND[cls] = (f"hf:{form}", "") if form else (None, "forward is not a known RMSNorm form")
    return _HF_KIND[cls]


def _hf_namespace(kind: str) -> dict:
    _, _, forward, eps_attr = _HF_FORMS[kind.removeprefix("hf:")]
    return {"forward": forward, "_normkit_eps_attr": eps_attr}


# --- torch.nn families --------------------------------------------------------------------------------

_TORCH = {  # flag -> [(torch class, normkit twin)]
    "layer_norm": [(nn.LayerNorm, nkn.LayerNorm)],
    "rms_norm": [(nn.RMSNorm, nkn.RMSNorm)],
    "group_norm": [(nn.GroupNorm, nkn.GroupNorm)],
    "batch_norm": [(nn.BatchNorm1d, nkn.BatchNorm1d), (nn.BatchNorm2d, nkn.BatchNorm2d),
                   (nn.BatchNorm3d, nkn.BatchNorm3d)],  # fmt: skip
    "instance_norm": [(nn.InstanceNorm1d, nkn.InstanceNorm1d), (nn.InstanceNorm2d, nkn.InstanceNorm2d),
                      (nn.InstanceNorm3d, nkn.InstanceNorm3d)],  # fmt: skip
}
_TWINS = {twin.__name__: twin for pairs in _TORCH.values() for _, twin in pairs}
_TORCH_FAMILIES = (_NormBase, *(base for pairs in _TORCH.values() for base, _ in pairs))
_COMPUTING = ("forward", "_apply_instance_norm")  # the methods a normkit.nn twin defines


def _twin_namespace(kind: str) -> dict:
    twin = _TWINS[kind]
    return {name: twin.__dict__[name] for name in _COMPUTING if name in twin.__dict__}


# --- patched classes ----------------------------------------------------------------------------------

_SUBCLASSES: dict[tuple[type, str], type] = {}


def _rebuild(cls: type, kind: str):
    """Unpickling / deepcopy of a patched instance: an empty instance of the same patched class."""
    return object.__new__(_subclass(cls, kind))


def _reduce_ex(self, protocol):
    return _rebuild, (type(self).__bases__[0], type(self)._normkit_kind), self.__getstate__()


def _subclass(cls: type, kind: str) -> type:
    """``cls`` with the computing methods of ``kind`` (a normkit.nn twin's name or an HF form)."""
    key = (cls, kind)
    if key not in _SUBCLASSES:
        namespace = _hf_namespace(kind) if kind.startswith("hf:") else _twin_namespace(kind)
        namespace.update(__module__=__name__, __qualname__=cls.__qualname__, __reduce_ex__=_reduce_ex,
                         _normkit_kind=kind, __doc__=f"{cls.__qualname__} running on normkit.")  # fmt: skip
        _SUBCLASSES[key] = type(cls.__name__, (cls,), namespace)
    return _SUBCLASSES[key]


def _is_normkit(cls: type) -> bool:
    return cls.__module__ in (nkn.__name__, __name__)


def _torch_target(module: nn.Module, flags: dict[str, bool]) -> tuple[type | None, str]:
    """(new class or None, reason when None) for a torch.nn norm module; (None, "") if not one."""
    cls = type(module)
    for flag, pairs in _TORCH.items():
        for base, twin in pairs:
            if not isinstance(module, base):
                continue
            if not flags[flag]:
                return None, ""
            methods = dict.fromkeys(("forward", *_twin_namespace(twin.__name__)))
            overridden = [n for n in methods if getattr(cls, n) is not getattr(base, n)]
            if overridden:
                return None, f"{cls.__name__} overrides {', '.join(overridden)}"
            return (twin if cls is base else _subclass(cls, twin.__name__)), ""
    if isinstance(module, _NormBase) and (flags["batch_norm"] or flags["instance_norm"]):
        if isinstance(module, LazyModuleMixin):
            return None, "uninitialized lazy module: patch after its first forward"
        return None, f"normkit has no replacement for {cls.__name__}"
    return None, ""


def _hf_target(module: nn.Module) -> tuple[type | None, str]:
    cls = type(module)
    if not cls.__name__.endswith("RMSNorm"):
        return None, ""
    kind, reason = _hf_kind(cls)
    if kind is None:
        return None, reason
    weight = getattr(module, "weight", None)
    eps = getattr(module, _hf_namespace(kind)["_normkit_eps_attr"], None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None, "weight is not a 1-D tensor"
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        return None, f"eps is not a number: {eps!r}"
    return _subclass(cls, kind), ""


def _check_call(fn: str, model, flags: dict) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module, got {type(model).__name__}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{fn}: {name} must be True or False, got {value!r}")


def patch(model: nn.Module, *, layer_norm: bool = True, rms_norm: bool = True, group_norm: bool = True,
          batch_norm: bool = True, instance_norm: bool = True, hf: bool = True) -> PatchReport:
    """Make ``model``'s norm modules (``model`` itself included) run on normkit, in place.

    Each flag enables one family: ``layer_norm``, ``rms_norm`` (torch.nn.RMSNorm), ``group_norm``,
    ``batch_norm`` (BatchNorm1d/2d/3d), ``instance_norm`` (InstanceNorm1d/2d/3d), ``hf`` (Hugging
    Face RMSNorm forms; see the module docstring). Modules already on normkit are left alone, so
    patching twice changes nothing. Returns the :class:`PatchReport`; undo with :func:`unpatch`.
    """
    flags = dict(layer_norm=layer_norm, rms_norm=rms_norm, group_norm=group_norm, batch_norm=batch_norm,
                 instance_norm=instance_norm, hf=hf)  # fmt: skip
    _check_call("patch", model, flags)
    report = PatchReport()
    for name, module in model.named_modules():
        cls = type(module)
        if _is_normkit(cls):
            continue
        new, reason = _torch_target(module, flags)
        if hf and not isinstance(module, _TORCH_FAMILIES):
            new, reason = _hf_target(module)
        if new is not None and "forward" in module.__dict__:
            new, reason = None, "forward is overridden on the instance"
        if new is not None:
            module.__dict__[_ORIGINAL] = cls
            module.__class__ = new
            report.patched.append(Patched(name, cls, new))
        elif reason:
            report.skipped.append(Skipped(name, cls, reason))
    return report


def unpatch(model: nn.Module) -> PatchReport:
    """Give every module that :func:`patch` changed its original class back (exact); returns the
    report of what was restored, as (name, patched class, original class)."""
    _check_call("unpatch", model, {})
    report = PatchReport()
    for name, module in model.named_modules():
        original = module.__dict__.pop(_ORIGINAL, None)
        if original is not None:
            report.patched.append(Patched(name, type(module), original))
            module.__class__ = original
    return report
