"""Device type -> backend module, chosen per call from the input's device.

Backends are imported lazily, on the first call that needs them: a CUDA machine never imports the
NPU backend's launch code paths it does not use, and a CPU machine never needs a GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import threading
from types import MappingProxyType, ModuleType
from typing import Iterator, Mapping

import torch

from normkit.errors import InvalidArgument

# The backend contract (docs/design.md): the functions a backend module may define. One it does not
# define is served by normkit.reference (plain PyTorch, any device), which defines them all; the
# backend names each one it leaves out, with why, in FALLS_BACK (contract function -> reason).
CONTRACT = (
    "layer_norm_fwd", "layer_norm_bwd", "rms_norm_fwd", "rms_norm_bwd", "softmax_fwd", "softmax_bwd",
    "add_layer_norm_fwd", "add_layer_norm_bwd", "add_rms_norm_fwd", "add_rms_norm_bwd", "group_norm_fwd",
    "group_norm_bwd", "batch_norm_stats", "batch_norm_apply", "batch_norm_train_fwd", "batch_norm_bwd",
)  # fmt: skip


def falls_back(module) -> dict[str, str]:
    """Contract function -> why, for those ``module`` (a backend) leaves to the reference."""
    return dict(getattr(module, "FALLS_BACK", {}))


# Adding a backend = a new folder under backends/ + one line here.
_REGISTRY: Mapping[str, str] = {
    "cuda": "normkit.backends.cuda",
    "npu": "normkit.backends.npu",
    "cpu": "normkit.reference",
}

# Per-context overrides, used by the test suite and `normkit check --interpret` to run a Triton
# backend's kernels on CPU tensors (interpreter) or the NPU kernels on a CUDA GPU, and to force a
# backend's launch strategies (use_strategy).
_OVERRIDES: contextvars.ContextVar[Mapping[str, object]] = contextvars.ContextVar(
    "normkit_backend_overrides", default=MappingProxyType({})
)


# Blocks running under an override, in any context (use_backend / restore): while there are none, a
# call needs no ContextVar read to know that no override applies (normkit.cpu's fast check, which
# torch.compile can also trace: it guards on this module global).
_IN_OVERRIDE = [0]
_COUNT_LOCK = threading.Lock()


@contextlib.contextmanager
def _counted() -> Iterator[None]:
    with _COUNT_LOCK:
        _IN_OVERRIDE[0] += 1
    try:
        yield
    finally:
        with _COUNT_LOCK:
            _IN_OVERRIDE[0] -= 1


def registered() -> dict[str, str]:
    """Device type -> module name of the backend serving it (overrides in effect included)."""
    return {**_REGISTRY, **{k: v for k, v in _OVERRIDES.get().items() if not k.endswith(_STRATEGY)}}


def backend_name_for(device: torch.device | str) -> str:
    """Module name of the backend that serves ``device`` (e.g. ``"normkit.backends.cuda"``)."""
    # A string is split by hand: torch.device("npu") is an error until torch_npu is loaded.
    device_type = device.split(":")[0] if isinstance(device, str) else torch.device(device).type
    table = registered()
    if device_type not in table:
        raise InvalidArgument(
            f"input is on device type '{device_type}', which no normkit backend serves; "
            f"supported device types: {', '.join(sorted(table))}"
        )
    return table[device_type]


_TRITON_HINT = {  # which install provides the `triton` module a backend was written for
    "normkit.backends.cuda": 'upstream Triton: pip install "normkit[cuda]" (torch\'s CUDA wheels bring it)',
    "normkit.backends.npu": 'triton-ascend on an Ascend host: pip install "normkit[npu]" (docs/backends.md); '
    "or upstream Triton to run the NPU kernels elsewhere",
}


# device type -> backend module, for calls with no override in effect: the per-call lookup of the
# launch path (a dict read instead of the registry merge and import machinery, ~10 us of host time
# per call on the H100 host; docs/tuning-log.md T12). Filled on first use.
_DEFAULT_MODULES: dict[str, ModuleType] = {}


def backend_for(device: torch.device | str) -> ModuleType:
    """The backend module that serves ``device``, imported on first use."""
    fast = type(device) is torch.device and not _OVERRIDES.get()
    if fast and device.type in _DEFAULT_MODULES:
        return _DEFAULT_MODULES[device.type]
    name = backend_name_for(device)
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != "triton" or name not in _TRITON_HINT:
            raise
        raise ModuleNotFoundError(
            f"{name} needs the `triton` module, which is not installed; install {_TRITON_HINT[name]}",
            name="triton",
        ) from e
    if fast:
        _DEFAULT_MODULES[device.type] = module
    return module


def served(device: torch.device) -> ModuleType | None:
    """The backend already serving ``device`` when no override is in effect, else None: the launch
    path's fast lookup (no registry merge, no import machinery)."""
    return None if _OVERRIDES.get() else _DEFAULT_MODULES.get(device.type)


def overrides() -> Mapping[str, object]:
    """The overrides in effect in this context (for :func:`restore`)."""
    return _OVERRIDES.get()


@contextlib.contextmanager
def restore(saved: Mapping[str, object]) -> Iterator[None]:
    """Run the block under overrides saved by :func:`overrides` in another context. The autograd
    engine runs a CUDA backward on its own thread, where the forward's context is not set."""
    token = _OVERRIDES.set(saved)
    try:
        with _counted() if saved else contextlib.nullcontext():
            yield
    finally:
        _OVERRIDES.reset(token)


# A backend's strategy override (the CUDA backend's config.Force) lives among the overrides under
# "<backend module>:strategy": it is part of the plan signatures (plans.overrides_key) and
# travels to the autograd engine's thread with them (restore).
_STRATEGY = ":strategy"


@contextlib.contextmanager
def use_strategy(module_name: str, value) -> Iterator[None]:
    """Hand ``value`` (hashable; the backend's own type) to the launch choices of the backend
    ``module_name`` inside the block (this context only, whichever device it serves);
    :func:`strategy` reads it."""
    token = _OVERRIDES.set({**_OVERRIDES.get(), module_name + _STRATEGY: value})
    try:
        with _counted():
            yield
    finally:
        _OVERRIDES.reset(token)


def strategy(module_name: str):
    """The value of the innermost :func:`use_strategy` block of backend ``module_name`` in effect here,
    or None."""
    overrides = _OVERRIDES.get()
    return overrides.get(module_name + _STRATEGY) if overrides else None


@contextlib.contextmanager
def use_backend(device_type: str, module_name: str) -> Iterator[None]:
    """Serve ``device_type`` with ``module_name`` inside the block (this context only)."""
    token = _OVERRIDES.set({**_OVERRIDES.get(), device_type: module_name})
    try:
        with _counted():
            yield
    finally:
        _OVERRIDES.reset(token)


def check_devices(input: torch.Tensor, *, op: str | None = None, input_name: str = "input",
                  **others: torch.Tensor | None) -> None:
    """Every tensor of ``others`` (argument name -> tensor or None) on ``input``'s device, or an
    error naming the argument (prefixed with ``op: `` when given, as the other argument errors)."""
    for name, tensor in others.items():
        if tensor is not None and tensor.device != input.device:
            raise InvalidArgument(
                f"{op + ': ' if op else ''}{name} is on device {tensor.device} but {input_name} is on "
                f"{input.device}; all tensors of one call must be on the same device"
            )


def backend_for_tensors(input: torch.Tensor, *, op: str | None = None, input_name: str = "input",
                        **others: torch.Tensor | None) -> ModuleType:
    """Backend for ``input``'s device, after checking every other tensor lives on that device."""
    check_devices(input, op=op, input_name=input_name, **others)
    return backend_for(input.device)
