"""What `normkit bench` measures, without torch: implementations, devices, ops, dtypes, suites and
their shapes, the case plan (``plan``, ``shard``) and the CLI's argument types.

Kept apart from :mod:`normkit.bench` (which imports torch) so that ``normkit --help`` and
``normkit bench --help`` build their text without importing torch; normkit.bench re-exports all of it.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

# The first paragraph of normkit.bench's docstring: `normkit bench --help`'s description.
DESCRIPTION = (
    "`normkit bench`: normkit, torch eager, torch.compile (and Liger-Kernel, quack when importable) side\n"
    "by side on a CUDA GPU, or normkit, torch eager and torch_npu's fused ops on an Ascend NPU, forward and\n"
    "backward, in GB/s and as fractions of a device-to-device copy timed in the same run."
)

IMPLS = ("normkit", "torch", "torch.compile", "liger", "quack", "torch_npu", "npu-kernels-on-cuda")
# Measured only when named in --impls: normkit's NPU backend launched on CUDA tensors, to show what
# the Ascend launch rules (1024-column tile, persistent grid) cost on a GPU. Not an NPU measurement.
OPT_IN = ("npu-kernels-on-cuda",)
DEVICES = ("auto", "cuda", "npu", "cpu")  # --device; auto: cuda if available, else npu (never cpu)
ROW_OPS = ("layer_norm", "rms_norm", "softmax", "log_softmax", "add_layer_norm", "add_rms_norm")
IMAGE_OPS = ("group_norm", "batch_norm")
DIM0_OPS = ("softmax_dim0", "log_softmax_dim0")
OPS = ROW_OPS + IMAGE_OPS + DIM0_OPS
DTYPES = ("float16", "bfloat16", "float32")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}  # bytes per element
SUITES = ("sweep", "small", "few", "image", "image_cl", "dim0")

UNITS = {  # (forward, backward) bytes moved, in units of the input tensor's bytes (see module doc)
    "layer_norm": (2, 3), "rms_norm": (2, 3), "softmax": (2, 3), "log_softmax": (2, 3),
    "add_layer_norm": (4, 4), "add_rms_norm": (4, 4), "group_norm": (2, 3), "batch_norm": (2, 3),
    "softmax_dim0": (2, 3), "log_softmax_dim0": (2, 3),
}  # fmt: skip

TOTAL = 1 << 27  # elements per row-op tensor
SWEEP_NS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
SMALL_NS = (64, 128, 256, 512)
FEW_MS, FEW_NS = (1, 16, 128), (4096, 8192)
# (N, C, H, W): ResNet-50 training activations at batch 128 / 256 (2^26.6 elements, like the sweep's
# 2^27: at bf16 the forward's copy takes ~137 us on an H100, above the ~100-200 us of an eager call's
# host time, so the cells time the GPU), and the smaller 32x256x56x56, where host time shows.
IMAGE_SHAPES = ((128, 256, 56, 56), (256, 512, 28, 28), (128, 64, 112, 112), (32, 256, 56, 56))
DIM0_NS = (1024, 4096, 32768)
GROUPS = 32  # group_norm's num_groups


# --- cases ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One (op, dtype, tensor shape), listed under the first suite that asked for it."""

    suite: str
    op: str
    dtype: str
    shape: tuple[int, ...]  # rows (M, N); dim0: (N, M), reduced along dim 0; image: (N, C, H, W)
    dropout: float = 0.0  # the add-norms' dropout_p (--dropout); 0 for every other op

    @property
    def channels_last(self) -> bool:
        """x and dy in torch.channels_last (the image_cl suite): the kernels read that layout."""
        return self.suite == "image_cl"

    @property
    def label(self) -> str:
        return ("x".join(map(str, self.shape)) + ("-cl" if self.channels_last else "")
                + (f"-p{self.dropout:g}" if self.dropout else ""))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def n(self) -> int:
        """Length of one reduction (row length; dim 0; a group's or a channel's element count)."""
        if self.op == "group_norm":
            return self.shape[1] // GROUPS * math.prod(self.shape[2:])
        if self.op == "batch_norm":
            return self.shape[0] * math.prod(self.shape[2:])
        return self.shape[0] if self.op in DIM0_OPS else self.shape[-1]

    @property
    def m(self) -> int:
        return self.numel // self.n

    def bytes(self) -> tuple[int, int]:
        return tuple(u * self.numel * ITEMSIZE[self.dtype] for u in UNITS[self.op])


def _suite_shapes(suite, ns, quick):
    """(ops, shapes) of one suite; ``ns`` overrides the row lengths of the N-swept suites."""
    if suite in ("image", "image_cl"):
        return IMAGE_OPS, IMAGE_SHAPES[:1] if quick else IMAGE_SHAPES
    default = {"sweep": SWEEP_NS, "small": SMALL_NS, "few": FEW_NS, "dim0": DIM0_NS}[suite]
    ns = ns or ([{"sweep": 4096, "small": 256, "few": 4096, "dim0": 4096}[suite]] if quick else default)
    if suite == "few":
        return ROW_OPS, [(m, n) for m in ((16,) if quick else FEW_MS) for n in ns]
    if suite == "dim0":
        return DIM0_OPS, [(n, max(1, TOTAL // n)) for n in ns]
    return ROW_OPS, [(max(1, TOTAL // n), n) for n in ns]


def plan(suites=SUITES, ops=None, dtypes=None, ns=None, quick=False, dropout=0.0) -> list[Case]:
    """The cases of ``suites`` (op-major, then dtype, then shape); a repeated (op, dtype, shape) once.
    ``dropout``: the add-norms' dropout_p."""
    dtypes = dtypes or (["bfloat16"] if quick else list(DTYPES))
    cases, seen = [], set()
    for suite in suites:
        suite_ops, shapes = _suite_shapes(suite, ns, quick)
        for op in suite_ops:
            if ops and op not in ops:
                continue
            for dtype in dtypes:
                for shape in shapes:
                    key = (op, dtype, tuple(shape), suite == "image_cl")
                    if key not in seen:
                        seen.add(key)
                        p = dropout if op.startswith("add_") else 0.0
                        cases.append(Case(suite, op, dtype, tuple(shape), p))
    return cases


def shard(cases, spec):
    """Every K-th case from the I-th (``spec`` = (I, K), 1-based): K invocations cover all cases."""
    i, k = spec
    return cases[i - 1 :: k]


# --- argument types (used by the CLI) ------------------------------------------------------------


def comma_list(choices, what):
    """argparse type: a comma-separated list whose items must be in ``choices``."""

    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad) or repr(text)}; "
                                             f"choose from {','.join(choices)}")
        return items

    return parse


def int_list(text):
    """argparse type: comma-separated positive ints."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def rounds(text):
    """argparse type: a count of rounds, a positive int."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def dropout_p(text):
    """argparse type: a dropout probability in [0, 1)."""
    try:
        p = float(text)
    except ValueError:
        p = -1.0
    if not 0.0 <= p < 1.0:
        raise argparse.ArgumentTypeError(f"expected a dropout probability in [0, 1), got {text!r}")
    return p


def shard_spec(text):
    """argparse type: I/K with 1 <= I <= K."""
    try:
        i, k = (int(t) for t in text.split("/"))
    except ValueError:
        i = k = 0
    if not 1 <= i <= k:
        raise argparse.ArgumentTypeError(f"expected I/K with 1 <= I <= K (e.g. 2/4), got {text!r}")
    return i, k
