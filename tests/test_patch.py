"""normkit.patch / unpatch on existing models: torch.nn norm modules, Hugging Face RMSNorm forms (a tiny
Llama from a config, Gemma's 1 + weight), parameters kept, report, exact unpatch."""

import collections
import contextlib
import copy
import functools
import pickle

import pytest
import torch
from conftest import DEVICE, INTERPRETER
from torch import nn

import normkit
import normkit.nn as nkn
from normkit import distributed
from normkit.patching import PatchReport
from normkit.testing import assert_close

EXECUTORS = [None] + INTERPRETER + [pytest.param(e, marks=m) for e, m in DEVICE]


def _executor_id(ex):
    return ex.name if ex is not None else "reference"


class TaggedLayerNorm(nn.LayerNorm):
    """A subclass that keeps LayerNorm's forward: patched through a subclass made by normkit.patch."""

    def __init__(self, n):
        super().__init__(n)
        self.tag = "kept"


class DoubledLayerNorm(nn.LayerNorm):
    """Overrides forward: left alone and reported as skipped."""

    def forward(self, input):
        return super().forward(input) * 2


class Net(nn.Module):
    """conv -> BatchNorm2d (cumulative) -> GroupNorm -> InstanceNorm2d (tracked) -> pool -> a LayerNorm
    used twice, a Sequential with a LayerNorm subclass, RMSNorm and an overriding subclass."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8, momentum=None)
        self.gn = nn.GroupNorm(2, 8)
        self.inorm = nn.InstanceNorm2d(8, affine=True, track_running_stats=True)
        self.norm_a = self.norm_b = nn.LayerNorm(8)
        self.head = nn.Sequential(nn.Linear(8, 16), TaggedLayerNorm(16), nn.GELU(), nn.Linear(16, 8),
                                  nn.RMSNorm(8), DoubledLayerNorm(8))  # fmt: skip

    def forward(self, x):
        h = self.inorm(self.gn(self.bn(self.conv(x)))).mean((2, 3))
        return self.norm_b(self.head(self.norm_a(h)))


NET_PATCHED = {  # name -> class after patching (None: a subclass of the original made by normkit.patch)
    "bn": nkn.BatchNorm2d, "gn": nkn.GroupNorm, "inorm": nkn.InstanceNorm2d, "norm_a": nkn.LayerNorm,
    "head.1": None, "head.4": nkn.RMSNorm,
}  # fmt: skip


def _randomize_norms(model, g):
    """Norm weights in [0.5, 1.5), biases around 0 (not the initializer's ones and zeros)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)):
                for name, p in module.named_parameters():
                    p.copy_(torch.rand(p.shape, generator=g) + (0.5 if name == "weight" else -0.5))


def _net():
    torch.manual_seed(0)
    model = Net()
    _randomize_norms(model, torch.Generator().manual_seed(0))
    return model


@pytest.fixture
def calls(monkeypatch):
    """Counts of normkit's public calls (normkit.distributed, what normkit.* and the patched
    forwards call, looked up at call time; on CPU it serves them with torch's operators)."""
    counts = collections.Counter()
    for name in ("layer_norm", "rms_norm", "group_norm", "instance_norm", "batch_norm"):
        fn = getattr(distributed, name)

        def spy(*args, _fn=fn, _name=name, **kwargs):
            counts[_name] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(distributed, name, spy)
    return counts


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_run(model, ref, x, dy, rows, dtype=torch.float32):
    """One forward + backward of both models: outputs and every parameter gradient."""
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    y, ry = model(x), ref(x)
    assert_close(y, ry, dtype, "fwd", "y")
    y.backward(dy)
    ry.backward(dy)
    got, expected = _grads(model), _grads(ref)
    assert list(got) == list(expected)
    for name, grad in expected.items():
        assert_close(got[name], grad, dtype, "param", f"d{name}", rows)


def test_patch_small_model_trains_like_torch(calls):
    model = _net()
    ref = copy.deepcopy(model)
    params, keys = list(model.parameters()), list(model.state_dict())
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    hooked = []
    model.norm_a.register_forward_hook(lambda *_: hooked.append(1))

    report = normkit.patch(model)

    assert isinstance(report, PatchReport) and len(report) == len(NET_PATCHED)
    assert [p.name for p in report] == list(NET_PATCHED)  # the shared LayerNorm once, first name
    for name, old, new in report:
        module = model.get_submodule(name)
        assert type(module) is new and issubclass(new, old) and old is type(ref.get_submodule(name))
        assert new is (NET_PATCHED[name] or new) and new.__name__ == old.__name__
    assert type(model.head[1]).__module__ == "normkit.patching" and model.head[1].tag == "kept"
    assert [(s.name, s.cls) for s in report.skipped] == [("head.5", DoubledLayerNorm)]
    assert "overrides forward" in report.skipped[0].reason
    assert all(a is b for a, b in zip(model.parameters(), params)) and list(model.state_dict()) == keys

    g = torch.Generator().manual_seed(1)
    for step in range(3):  # training: batch statistics, running statistics, optimizer steps
        x = torch.randn(4, 3, 5, 5, generator=g) * (step + 1) + step
        _assert_same_run(model, ref, x, torch.randn(4, 8, generator=g), rows=4)
        opt.step(), ref_opt.step()
        for (name, buf), (_, rbuf) in zip(model.named_buffers(), ref.named_buffers()):
            assert_close(buf, rbuf, torch.float32, "fwd", name)
    assert calls == dict(batch_norm=3, group_norm=3, instance_norm=3, layer_norm=9, rms_norm=3)
    assert len(hooked) == 6  # norm_a is also norm_b: two calls per forward
    model.eval(), ref.eval()
    x = torch.randn(2, 3, 5, 5, generator=g)
    assert_close(model(x), ref(x), torch.float32, "fwd", "eval y")

    restored = normkit.unpatch(model)
    assert [(p.name, p.old, p.new) for p in restored] == [(p.name, p.new, p.old) for p in report]
    for name, module in ref.named_modules():
        assert type(model.get_submodule(name)) is type(module), name
    assert not any("_normkit_original_class" in m.__dict__ for m in model.modules())
    assert_close(model(x), ref(x), torch.float32, "fwd", "unpatched y")
    assert len(normkit.unpatch(model)) == 0


def test_unpatch_is_exact():
    model = _net().eval()
    x = torch.randn(2, 3, 5, 5)
    before, state = model(x), copy.deepcopy(model.state_dict())
    normkit.patch(model)
    normkit.unpatch(model)
    assert torch.equal(model(x), before)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_flags_repatch_and_report():
    model = _net()
    report = normkit.patch(model, layer_norm=False, batch_norm=False, rms_norm=False)
    assert [p.name for p in report] == ["gn", "inorm"] and report.skipped == []
    again = normkit.patch(model)
    assert [p.name for p in again] == ["bn", "norm_a", "head.1", "head.4"]
    third = normkit.patch(model)
    assert len(third) == 0 and str(third) == (
        "head.5: test_patch.DoubledLayerNorm skipped (DoubledLayerNorm overrides forward)"
    )
    assert "bn: torch.nn.modules.batchnorm.BatchNorm2d -> normkit.nn.BatchNorm2d" in str(again)
    assert str(PatchReport()) == "nothing to patch"


def test_skips_with_reasons():
    odd = nn.LayerNorm(4)
    odd.forward = lambda x: x  # an instance-level override
    model = nn.Sequential(nn.SyncBatchNorm(4), nn.LazyBatchNorm1d(), odd, nn.Softmax(-1))
    report = normkit.patch(model)
    assert len(report) == 0
    reasons = {s.name: s.reason for s in report.skipped}
    assert reasons == {"0": "normkit has no replacement for SyncBatchNorm",
                       "1": "uninitialized lazy module: patch after its first forward",
                       "2": "forward is overridden on the instance"}  # fmt: skip


def test_root_module_and_errors():
    ln = nn.LayerNorm(8)
    report = normkit.patch(ln)
    assert type(ln) is nkn.LayerNorm and str(report) == (
        "<root>: torch.nn.modules.normalization.LayerNorm -> normkit.nn.LayerNorm"
    )
    with pytest.raises(TypeError, match="patch: model must be a torch.nn.Module, got str"):
        normkit.patch("model")
    with pytest.raises(TypeError, match="patch: hf must be True or False, got 1"):
        normkit.patch(ln, hf=1)
    with pytest.raises(TypeError, match="unpatch: model must be"):
        normkit.unpatch(None)


def test_pickle_and_deepcopy_keep_the_patch():
    model = _net().eval()
    normkit.patch(model)
    x = torch.randn(2, 3, 5, 5)
    for other in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert [type(m) for m in other.modules()] == [type(m) for m in model.modules()]
        assert torch.equal(other(x), model(x))
        normkit.unpatch(other)
        assert type(other.head[1]) is TaggedLayerNorm and type(other.bn) is nn.BatchNorm2d


# --- Hugging Face RMSNorm forms ----------------------------------------------------------------------


class GemmaRMSNorm(nn.Module):
    """transformers' GemmaRMSNorm, verbatim (the forward is what normkit.patch recognises)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        # Llama does x.to(float16) * w whilst Gemma is (x * w).to(float16)
        # See https://github.com/huggingface/transformers/pull/29402
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class RenamedLlamaRMSNorm(nn.Module):
    """LlamaRMSNorm's forward with other names, annotations, a docstring and comments: recognised."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """Normalize."""
        dt = states.dtype
        states = states.to(torch.float32)  # fp32 math
        var = states.pow(2).mean(-1, keepdim=True)
        states = states * torch.rsqrt(var + self.variance_epsilon)
        return self.weight * states.to(dt)


class CastAfterRMSNorm(RenamedLlamaRMSNorm):
    """GptOssRMSNorm's form: one rounding, after the weight."""

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class InputScaledRMSNorm(GemmaRMSNorm):
    """Gemma's attributes, but the weight scales the input before the norm: not recognised."""

    def forward(self, x):
        output = x.float() * (1.0 + self.weight).float()
        output = self._norm(output.type_as(x).float())
        return output.type_as(x)


def _logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


class WrappedRMSNorm(RenamedLlamaRMSNorm):
    forward = _logged(RenamedLlamaRMSNorm.forward)


class LlamaNamedOtherwise(RenamedLlamaRMSNorm):
    """A recognised forward, but not an *RMSNorm class name: not an HF RMSNorm candidate."""


def _hf_classes():
    """(GemmaRMSNorm, LlamaRMSNorm) from transformers, or skip."""
    pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemma
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return HFGemma, LlamaRMSNorm


def _rms_module(source, dtype, weight_dtype=None):
    cls = {"stand-in": GemmaRMSNorm, "renamed-llama": RenamedLlamaRMSNorm, "cast-after": CastAfterRMSNorm,
           "gemma": lambda n: _hf_classes()[0](n),
           "llama": lambda n: _hf_classes()[1](n)}[source]  # fmt: skip
    module = cls(64).to(dtype)
    with torch.no_grad():  # Gemma's weight is an offset from 1: around 0; the others around 1
        offset = 0.0 if "gemma" in source or source == "stand-in" else 1.0
        w = torch.randn(64, generator=torch.Generator().manual_seed(5)) * 0.3 + offset
        module.weight = nn.Parameter(w.to(weight_dtype or dtype))
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("source", ["stand-in", "gemma", "renamed-llama", "llama", "cast-after"])
def test_hf_rms_forms_match(source, dtype):
    """Patched vs the original forward: y (in the original's dtype), dx and dweight. The Llama form
    rounds once where HF rounds twice: within the dtype's forward tolerance (about one ulp)."""
    module = _rms_module(source, dtype)
    ref = copy.deepcopy(module)
    report = normkit.patch(module)
    assert len(report) == 1 and report.patched[0].old is type(ref), report
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(5, 7, 64, generator=g) * 3).to(dtype)
    _assert_same_run(module, ref, x, torch.randn(5, 7, 64, generator=g).to(dtype), rows=35, dtype=dtype)
    ulp = torch.finfo(dtype).eps
    err = (module(x).double() - ref(x).double()).abs() / ref(x).double().abs().clamp_min(ulp)
    assert err.max() <= 2 * ulp, f"max relative difference {err.max():.3g} > 2 ulp ({ulp:.3g})"


@pytest.mark.parametrize("source", ["renamed-llama", "llama"])
def test_hf_llama_form_fp32_weight_bf16_input(source):
    """fp32 weight, bf16 input: HF returns fp32 (weight * normalized x rounded to bf16): kept."""
    module = _rms_module(source, torch.float32)
    ref = copy.deepcopy(module)
    normkit.patch(module)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    y, ry = module(x), ref(x)
    assert y.dtype == ry.dtype == torch.float32
    assert_close(y, ry, torch.bfloat16, "fwd", "y")


@pytest.mark.parametrize("cls,reason", [
    (InputScaledRMSNorm, "forward is not a known RMSNorm form"),
    (WrappedRMSNorm, "forward is wrapped by a decorator"),
    (LlamaNamedOtherwise, None),
], ids=["weight-before-norm", "wrapped-forward", "other-name"])  # fmt: skip
def test_hf_unknown_forms_are_left_alone(cls, reason):
    module = cls(8)
    report = normkit.patch(module)
    assert type(module) is cls and len(report) == 0
    assert [s.reason for s in report.skipped] == ([reason] if reason else [])


def test_hf_eps_must_be_a_number():
    module = RenamedLlamaRMSNorm(8)
    module.variance_epsilon = "1e-6"
    assert [s.reason for s in normkit.patch(module).skipped] == ["eps is not a number: '1e-6'"]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3",
                                  "gpt_oss", "helium"])  # fmt: skip
def test_hf_model_families_are_recognised(name):
    transformers = pytest.importorskip("transformers")
    module = pytest.importorskip(f"transformers.models.{name}.modeling_{name}")
    classes = [getattr(module, n) for n in dir(module) if n.endswith("RMSNorm")]
    assert classes, f"no RMSNorm class in transformers {transformers.__version__} {name}"
    for cls in classes:
        norm = cls(16)
        report = normkit.patch(norm)
        assert len(report) == 1, f"{cls.__name__}: {report}"


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=128)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # non-trivial norm weights (the initializer sets them to 1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("executor", EXECUTORS, ids=_executor_id)
def test_patch_tiny_llama(run_on, executor):
    """Logits and every parameter gradient of a 2-layer Llama from a config (no download) match the
    unpatched model; the report lists the 5 RMSNorms; unpatch restores classes and exact logits."""
    backend = run_on(executor, torch.float32) if executor is not None else contextlib.nullcontext()
    device = executor.device if executor is not None else "cpu"
    model = _tiny_llama().to(device)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0)).to(device)
    report = normkit.patch(model)
    names = [f"model.layers.{i}.{k}_layernorm" for i in range(2) for k in ("input", "post_attention")]
    assert [p.name for p in report] == names + ["model.norm"]
    assert {p.old.__name__ for p in report} == {"LlamaRMSNorm"} and report.skipped == []
    with backend:
        out = model(ids, labels=ids)
        out.loss.backward()
    expected = ref(ids, labels=ids)
    expected.loss.backward()
    assert_close(out.logits, expected.logits, torch.float32, "fwd", "logits")
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, rp.grad, torch.float32, "param", f"d{name}", rows=ids.numel())
    normkit.unpatch(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("executor", [None] + [pytest.param(e, marks=m) for e, m in DEVICE], ids=_executor_id)
def test_patched_tiny_llama_compiles_fullgraph(run_on, executor):
    """The patched Llama traces with torch.compile(fullgraph=True) and no graph break (normkit's ops
    are custom operators); the compiled logits and gradients match the unpatched eager model."""
    backend = run_on(executor, torch.float32) if executor is not None else contextlib.nullcontext()
    device = executor.device if executor is not None else "cpu"
    model = _tiny_llama().to(device)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    normkit.patch(model)
    torch._dynamo.reset()
    with backend:
        explained = torch._dynamo.explain(lambda t: model(t).logits)(ids)
        assert explained.graph_break_count == 0, explained.break_reasons
        compiled = torch.compile(lambda t: model(t, labels=t), fullgraph=True)
        out = compiled(ids)
        out.loss.backward()
    expected = ref(ids, labels=ids)
    expected.loss.backward()
    assert_close(out.logits, expected.logits, torch.float32, "fwd", "logits")
    for (name, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, rp.grad, torch.float32, "param", f"d{name}", rows=ids.numel())
