// The native host path of the CUDA plans (backends/cuda/native.py): a plan's launches replayed from
// C++, and its training step as a C++ autograd node, so that a call costs one Python -> C++ call
// and its backward no Python at all.
//
// A Program is what native.py recorded from one run of a plan: the tensors it allocates (shape,
// dtype, zeroed or not), the compiled Triton kernels it launches (CUfunction, grid, threads, dynamic
// shared memory) and each kernel parameter as a slot's address (+ a byte offset), or a fixed int /
// float. Slots 0 .. n_inputs-1 are the call's tensors, the next ones the allocations. run() allocates
// on the device of its first input and launches on that device's current stream with the driver's
// cuLaunchKernel (looked up in the already loaded libcuda: nothing is linked). The parameter list is
// checked once against the cubin's own (cuFuncGetParamInfo): a Triton release whose launcher passes
// something else (a scratch pointer) gets NULL there; any other mismatch refuses the program.
//
// Node: a training plan as a torch::autograd::Function. forward runs the forward program, saves the
// tensors the backward needs, returns the differentiable outputs. backward runs the backward program
// chosen by which incoming gradients are defined; with create_graph (grad mode on), an undefined
// first gradient or no program for the variant yet, it calls the plan's Python backward (under the
// GIL), which is differentiable again and records the missing variant.
//
// Door: the front door of softmax / log_softmax, layer_norm and rms_norm, the calls whose whole cost
// in torch is a few µs of host. A recorded plan of theirs is also entered here under its call's
// signature (the Python plan key's parts that vary without overrides: op, gradient wanted, each
// tensor's kind, shape, dtype, device and 16-byte alignment, normalized_shape, eps), and
// normkit.softmax / layer_norm / rms_norm try door(...) first: one C++ call that checks the
// arguments, finds the program (or the training spec) and runs it, instead of the front end's
// checks, the plan key and the plan's wrappers in Python. It serves nothing while a Triton launch
// hook or the tests' launch recording is set (what launch.quiet() checks), and it is emptied with
// the plan cache.

#include <torch/extension.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Size.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <dlfcn.h>

#include <array>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// A failed check, raised as RuntimeError with a printf-style message handed to libc10 as a C string.
// (TORCH_CHECK with a message of several parts builds it as a std::string in this library: on the
// H100 machine's torch 2.11.0+cu130 with GCC 13.3 such a check crashed the process, a segfault,
// instead of raising; one C-string part raises. Every check here goes through this.)
[[noreturn]] __attribute__((format(printf, 1, 2))) void fail(const char* format, ...) {
  char message[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(message, sizeof message, format, args);
  va_end(args);
  TORCH_CHECK(false, static_cast<const char*>(message));
}
#define NK_CHECK(cond, ...) \
  do {                      \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (0)

// --- the driver: three entry points of libcuda, found at run time ---------------------------------
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                         void**, void**);
using ParamInfoFn = int (*)(void*, size_t, size_t*, size_t*);
using ErrorFn = int (*)(int, const char**);

struct Driver {
  LaunchFn launch = nullptr;
  ParamInfoFn param_info = nullptr;
  ErrorFn error = nullptr;
};

const Driver& driver() {
  static Driver d = [] {
    Driver out;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    NK_CHECK(lib != nullptr, "normkit native: libcuda.so.1 is not loadable: %s", dlerror());
    out.launch = reinterpret_cast<LaunchFn>(dlsym(lib, "cuLaunchKernel"));
    out.param_info = reinterpret_cast<ParamInfoFn>(dlsym(lib, "cuFuncGetParamInfo"));
    out.error = reinterpret_cast<ErrorFn>(dlsym(lib, "cuGetErrorString"));
    NK_CHECK(out.launch != nullptr, "normkit native: libcuda has no cuLaunchKernel");
    return out;
  }();
  return d;
}

const char* driver_error(int code) {
  const char* text = nullptr;
  if (driver().error != nullptr) driver().error(code, &text);
  return text != nullptr ? text : "unknown";
}

// --- programs ------------------------------------------------------------------------------------
enum Kind : int64_t { PTR = 0, I32 = 1, I64 = 2, F32 = 3, NUL = 4, U64 = 5 };

struct Param {
  int64_t kind;
  int64_t a;  // PTR: slot; I32 / I64 / U64: the value
  int64_t b;  // PTR: byte offset
  double f;   // F32: the value
};

size_t param_size(int64_t kind) { return (kind == I32 || kind == F32) ? 4 : 8; }

struct Launch {
  void* function;
  std::array<unsigned, 3> grid;
  unsigned threads;
  unsigned shared;
  std::vector<Param> params;
};

struct Alloc {
  int64_t slot;
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  bool zero;
};

struct Program : torch::CustomClassHolder {
  int64_t n_inputs = 0, n_slots = 0;
  std::vector<Alloc> allocs;
  std::vector<Launch> launches;
  std::vector<int64_t> outputs;  // slot of each output, -1: None

  std::vector<at::Tensor> run(std::vector<at::Tensor> slots) const {
    NK_CHECK(static_cast<int64_t>(slots.size()) == n_inputs, "normkit native: program of %lld inputs given %zu",
             static_cast<long long>(n_inputs), slots.size());
    const at::Tensor first = slots[0];  // a copy: the resize below moves the slots
    c10::Device device = first.device();
    c10::impl::VirtualGuardImpl impl(device.type());
    std::optional<c10::DeviceGuard> guard;
    if (impl.getDevice() != device) guard.emplace(device);
    slots.resize(n_slots);
    auto options = first.options();
    for (const Alloc& a : allocs) {
      auto o = options.dtype(a.dtype);
      slots[a.slot] = a.zero ? at::zeros(a.shape, o) : at::empty(a.shape, o);
    }
    void* stream = launches.empty() ? nullptr : impl.getStream(device).native_handle();
    std::vector<uint64_t> values;
    std::vector<void*> pointers;
    for (const Launch& l : launches) {
      values.assign(l.params.size(), 0);
      pointers.resize(l.params.size());
      for (size_t i = 0; i < l.params.size(); ++i) {
        const Param& p = l.params[i];
        void* at = &values[i];
        switch (p.kind) {
          case PTR: {
            const at::Tensor& t = slots[p.a];
            uint64_t address = t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) + p.b : 0;
            values[i] = address;
            break;
          }
          case I32: *static_cast<int32_t*>(at) = static_cast<int32_t>(p.a); break;
          case I64: case U64: values[i] = static_cast<uint64_t>(p.a); break;
          case F32: *static_cast<float*>(at) = static_cast<float>(p.f); break;
          default: values[i] = 0;
        }
        pointers[i] = at;
      }
      int rc = driver().launch(l.function, l.grid[0], l.grid[1], l.grid[2], l.threads, 1, 1, l.shared, stream,
                               pointers.data(), nullptr);
      NK_CHECK(rc == 0, "normkit native: cuLaunchKernel failed: %d (%s)", rc, driver_error(rc));
    }
    std::vector<at::Tensor> out;
    out.reserve(outputs.size());
    for (int64_t s : outputs) out.push_back(s < 0 ? at::Tensor() : slots[s]);
    return out;
  }
};

// Program from native.py's lists; checks every launch's parameters against its cubin.
c10::intrusive_ptr<Program> make_program(int64_t n_inputs, int64_t n_slots, py::list allocs, py::list launches,
                                         std::vector<int64_t> outputs) {
  auto p = c10::make_intrusive<Program>();
  p->n_inputs = n_inputs;
  p->n_slots = n_slots;
  p->outputs = std::move(outputs);
  for (auto item : allocs) {
    auto t = item.cast<py::tuple>();
    p->allocs.push_back({t[0].cast<int64_t>(), t[1].cast<std::vector<int64_t>>(),
                         torch::python::detail::py_object_to_dtype(py::object(t[2])), t[3].cast<bool>()});
  }
  for (auto item : launches) {
    auto t = item.cast<py::tuple>();
    Launch l;
    l.function = reinterpret_cast<void*>(t[0].cast<uint64_t>());
    auto g = t[1].cast<std::vector<int64_t>>();
    NK_CHECK(g.size() == 3, "normkit native: a grid has 3 entries");
    l.grid = {static_cast<unsigned>(g[0]), static_cast<unsigned>(g[1]), static_cast<unsigned>(g[2])};
    l.threads = t[2].cast<unsigned>();
    l.shared = t[3].cast<unsigned>();
    for (auto q : t[4].cast<py::list>()) {
      auto v = q.cast<py::tuple>();
      l.params.push_back({v[0].cast<int64_t>(), v[1].cast<int64_t>(), v[2].cast<int64_t>(), v[3].cast<double>()});
    }
    // the cubin's own parameter list: ours must match it; trailing 8-byte ones (Triton's scratch
    // pointers) get NULL
    NK_CHECK(driver().param_info != nullptr, "normkit native: the driver has no cuFuncGetParamInfo");
    size_t offset = 0, size = 0, end = 0;
    for (size_t i = 0;; ++i) {
      int rc = driver().param_info(l.function, i, &offset, &size);
      if (rc != 0) {
        NK_CHECK(i >= l.params.size(), "normkit native: the kernel has %zu parameters, the plan %zu", i,
                 l.params.size());
        break;
      }
      if (i >= l.params.size()) {
        NK_CHECK(size == 8 && i < l.params.size() + 4, "normkit native: unexpected kernel parameter %zu of %zu bytes",
                 i, size);
        l.params.push_back({NUL, 0, 0, 0.0});
      }
      NK_CHECK(param_size(l.params[i].kind) == size, "normkit native: kernel parameter %zu is %zu bytes, the plan's %zu",
               i, size, static_cast<size_t>(param_size(l.params[i].kind)));
      NK_CHECK(offset >= end, "normkit native: kernel parameters out of order");
      end = offset + size;
    }
    p->launches.push_back(std::move(l));
  }
  return p;
}

// --- the autograd node -------------------------------------------------------------------------
struct Spec : torch::CustomClassHolder {
  c10::intrusive_ptr<Program> forward;
  std::array<c10::intrusive_ptr<Program>, 2> backward;  // by whether the second gradient is defined
  std::vector<int64_t> returned;       // forward outputs returned (differentiable)
  std::vector<int64_t> saved;          // saved tensors: >= 0 forward input i, < 0 forward output -1 - i
  std::vector<at::ScalarType> grad_dtypes;  // the backward's incoming gradients, as the program takes them
  PyObject* slow = nullptr;            // the plan's Python backward: slow(grads, saved) -> input grads
  std::mutex lock;

  ~Spec() override {
    if (slow != nullptr && Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      Py_DECREF(slow);
    }
  }
};

at::Tensor dense(const at::Tensor& g, at::ScalarType dtype) {
  if (g.scalar_type() == dtype && g.is_contiguous() && reinterpret_cast<uint64_t>(g.data_ptr()) % 16 == 0) {
    return g;
  }
  return g.to(dtype, /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Contiguous);
}

using Opt = std::optional<at::Tensor>;
// a node's inputs: x, residual, weight, bias (the row norms); x, weight, bias and the two running
// statistics (BatchNorm, which updates the last two in place and gives them no gradient)
constexpr size_t kMaxInputs = 5;

struct Node : public torch::autograd::Function<Node> {
  // inputs as optionals (an absent one is no autograd input); the program takes the first n_inputs
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<Spec> spec, const Opt& a, const Opt& b,
                               const Opt& c, const Opt& d, const Opt& e) {
    ctx->set_materialize_grads(false);
    std::vector<at::Tensor> in;
    for (const Opt* t : {&a, &b, &c, &d, &e}) in.push_back(t->has_value() ? **t : at::Tensor());
    in.resize(spec->forward->n_inputs);
    auto outs = spec->forward->run(in);
    variable_list saved;
    for (int64_t s : spec->saved) saved.push_back(s >= 0 ? in[s] : outs[-1 - s]);
    ctx->save_for_backward(saved);
    ctx->saved_data["spec"] = c10::IValue::make_capsule(spec);
    ctx->saved_data["inputs"] = static_cast<int64_t>(in.size());
    for (size_t i = 0; i < in.size(); ++i) {
      ctx->saved_data["sizes" + std::to_string(i)] = in[i].defined() ? c10::IValue(in[i].sizes()) : c10::IValue();
    }
    variable_list returned;
    for (int64_t r : spec->returned) returned.push_back(outs[r]);
    return returned;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto spec = c10::static_intrusive_pointer_cast<Spec>(ctx->saved_data["spec"].toCapsule());
    auto saved = ctx->get_saved_variables();
    size_t n_in = static_cast<size_t>(ctx->saved_data["inputs"].toInt());
    c10::intrusive_ptr<Program> program;
    bool fast = !at::GradMode::is_enabled() && !grads.empty() && grads[0].defined();
    if (fast) {
      size_t variant = grads.size() > 1 && grads[1].defined();
      std::lock_guard<std::mutex> hold(spec->lock);
      program = spec->backward[variant];
    }
    variable_list result;
    if (program) {
      std::vector<at::Tensor> in;
      for (size_t i = 0; i < spec->grad_dtypes.size(); ++i) {
        in.push_back(i < grads.size() && grads[i].defined() ? dense(grads[i], spec->grad_dtypes[i]) : at::Tensor());
      }
      in.insert(in.end(), saved.begin(), saved.end());
      result = program->run(in);
    } else {  // the plan's Python backward
      py::gil_scoped_acquire gil;
      py::list g, s;
      for (auto& t : grads) g.append(t.defined() ? py::cast(t) : py::none());
      for (auto& t : saved) s.append(t.defined() ? py::cast(t) : py::none());
      py::object out = py::reinterpret_borrow<py::object>(spec->slow)(g, s);
      for (auto item : out) result.push_back(item.is_none() ? at::Tensor() : item.cast<at::Tensor>());
    }
    NK_CHECK(result.size() == n_in, "normkit native: the backward gave %zu gradients for %zu inputs", result.size(),
             n_in);
    variable_list out(1 + kMaxInputs);  // the spec's, then one per input slot (undefined past n_in)
    for (size_t i = 0; i < n_in; ++i) {
      at::Tensor g = result[i];
      const c10::IValue& sizes = ctx->saved_data["sizes" + std::to_string(i)];
      if (sizes.isNone()) continue;  // no such input: no gradient
      if (g.defined()) {
        auto want = sizes.toIntVector();
        if (g.sizes() != c10::IntArrayRef(want)) g = g.view(want);
      }
      out[1 + i] = g;
    }
    return out;
  }
};

// --- the door -----------------------------------------------------------------------------------
// Entries are written and read with the GIL held (door_put / door_clear / door are Python calls).
struct DoorEntry {
  c10::intrusive_ptr<Program> program;  // inference
  c10::intrusive_ptr<Spec> spec;        // training
};

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& k) const {
    size_t h = 0;
    for (int64_t v : k) h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

struct DoorState {
  std::unordered_map<std::vector<int64_t>, DoorEntry, KeyHash> entries;
  PyObject* runtime = nullptr;  // triton.knobs.runtime: its launch hooks
  PyObject* launch = nullptr;   // normkit.backends.cuda.launch: its RECORD
  PyObject* enter = nullptr;    // interned attribute names
  PyObject* leave = nullptr;
  PyObject* calls = nullptr;
  PyObject* record = nullptr;
};

DoorState& door_state() {
  static auto* state = new DoorState();  // never destroyed: nothing to run at interpreter exit
  return *state;
}

// a tensor's part of a key: dtype, device index, 16-byte alignment, dims, sizes
void tensor_key(std::vector<int64_t>& k, const at::Tensor& t) {
  k.insert(k.end(), {static_cast<int64_t>(t.scalar_type()), t.device().index(),
                     reinterpret_cast<uint64_t>(t.data_ptr()) % 16 == 0, t.dim()});
  for (int64_t s : t.sizes()) k.push_back(s);
}

// softmax's key: op, whether a gradient is wanted, x
std::vector<int64_t> door_key(int64_t op, bool train, const at::Tensor& x) {
  std::vector<int64_t> k{op, train};
  tensor_key(k, x);
  return k;
}

enum DoorOp : int64_t { SOFTMAX = 0, LOG_SOFTMAX = 1, LAYER_NORM = 2, RMS_NORM = 3 };

// x as the door serves it: a plain contiguous CUDA tensor of one or more dims
const at::Tensor* door_input(PyObject* obj) {
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return nullptr;
  const at::Tensor& x = THPVariable_Unpack(obj);
  if (!x.is_cuda() || x.dim() == 0 || !x.is_contiguous()) return nullptr;
  return &x;
}

// layer_norm / rms_norm's key (op, x, normalized_shape, weight, bias, eps as the Python functions take
// them) and the tensors the program takes (x, no residual, weight, bias); false where the door cannot
// serve the call (a plan key of None, or arguments the Python path is to check)
bool norm_key(PyObject* const* args, bool grad_mode, std::vector<int64_t>& k, std::array<at::Tensor, 4>& in,
              bool& train) {
  int overflow = 0;
  long long op = PyLong_CheckExact(args[0]) ? PyLong_AsLongLongAndOverflow(args[0], &overflow) : -1;
  if (overflow != 0 || (op != LAYER_NORM && op != RMS_NORM)) return false;
  const at::Tensor* x = door_input(args[1]);
  if (x == nullptr) return false;
  train = grad_mode && x->requires_grad();
  k.assign({op, 0});
  tensor_key(k, *x);
  // normalized_shape: an int, or a tuple / list / torch.Size of ints (functional._shape_key)
  PyObject* shape = args[2];
  if (PyLong_CheckExact(shape)) {
    k.insert(k.end(), {1, PyLong_AsLongLongAndOverflow(shape, &overflow)});
  } else if (PyTuple_Check(shape) || PyList_CheckExact(shape)) {
    if (PyTuple_Check(shape) && !PyTuple_CheckExact(shape) && !THPSize_Check(shape)) return false;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(shape);
    k.push_back(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* d = PySequence_Fast_GET_ITEM(shape, i);
      if (!PyLong_CheckExact(d)) return false;
      k.push_back(PyLong_AsLongLongAndOverflow(d, &overflow));
      if (overflow != 0) return false;
    }
  } else {
    return false;
  }
  if (overflow != 0) return false;
  in[0] = *x;
  // weight, bias (rms_norm: bias None): None, or a contiguous Tensor / Parameter
  for (int i = 0; i < 2; ++i) {
    PyObject* t = args[3 + i];
    if (t == Py_None) {
      k.push_back(-1);
      continue;
    }
    bool parameter = Py_TYPE(t) == reinterpret_cast<PyTypeObject*>(ParameterClass);
    if (!parameter && Py_TYPE(t) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return false;
    const at::Tensor& p = THPVariable_Unpack(t);
    if (!p.is_cuda() || !p.is_contiguous()) return false;
    train = train || (grad_mode && p.requires_grad());
    k.push_back(parameter);
    tensor_key(k, p);
    in[2 + i] = p;
  }
  if (op == RMS_NORM && args[4] != Py_None) return false;
  // eps: a float (rms_norm: None is the input dtype's machine epsilon, as torch's)
  double eps;
  if (PyFloat_CheckExact(args[5])) {
    eps = PyFloat_AS_DOUBLE(args[5]);
  } else if (args[5] == Py_None && op == RMS_NORM) {
    switch (x->scalar_type()) {
      case at::kFloat: eps = std::numeric_limits<float>::epsilon(); break;
      case at::kDouble: eps = std::numeric_limits<double>::epsilon(); break;
      case at::kHalf: eps = 0.0009765625; break;
      case at::kBFloat16: eps = 0.0078125; break;
      default: return false;
    }
  } else {
    return false;
  }
  int64_t bits;
  std::memcpy(&bits, &eps, sizeof bits);
  k.push_back(bits);
  k[1] = train;
  return true;
}

// launch.quiet() in C++: no hook set whose `calls` is true (a hook without `calls` counts), no RECORD
bool hook_quiet(PyObject* name) {
  DoorState& d = door_state();
  PyObject* hook = PyObject_GetAttr(d.runtime, name);
  if (hook == nullptr) {
    PyErr_Clear();
    return false;
  }
  bool quiet = true;
  if (hook != Py_None) {
    PyObject* calls = PyObject_GetAttr(hook, d.calls);
    if (calls == nullptr) {
      PyErr_Clear();
      quiet = false;
    } else {
      quiet = PyObject_IsTrue(calls) == 0;
      Py_DECREF(calls);
    }
  }
  Py_DECREF(hook);
  return quiet;
}

bool door_quiet() {
  DoorState& d = door_state();
  PyObject* record = PyObject_GetAttr(d.launch, d.record);
  if (record == nullptr) {
    PyErr_Clear();
    return false;
  }
  bool none = record == Py_None;
  Py_DECREF(record);
  return none && hook_quiet(d.enter) && hook_quiet(d.leave);
}

// the entry's output for these inputs (x, residual, weight, bias; absent ones undefined)
PyObject* serve(const DoorEntry& e, bool train, const std::array<at::Tensor, 4>& in, size_t n) {
  if (train ? !e.spec : !e.program) Py_RETURN_NONE;
  at::Tensor y;
  if (train) {
    auto opt = [&](size_t i) { return i < n && in[i].defined() ? Opt(in[i]) : Opt(); };
    y = Node::apply(e.spec, opt(0), opt(1), opt(2), opt(3), std::nullopt)[0];
  } else {
    y = e.program->run(std::vector<at::Tensor>(in.begin(), in.begin() + n))[0];
  }
  return THPVariable_Wrap(std::move(y));
}

// the door's arguments (door's, below) -> the key, the tensors the entry takes (x, residual, weight,
// bias; absent ones undefined) and how many, and whether a gradient is wanted (with grad mode as
// given); false where the door does not serve them. One parser for the calls and the entries made.
bool door_args(PyObject* const* args, Py_ssize_t n, bool grad_mode, std::vector<int64_t>& k,
               std::array<at::Tensor, 4>& in, size_t& n_in, bool& train) {
  if (n == 6) {
    n_in = 4;
    return norm_key(args, grad_mode, k, in, train);
  }
  if (n != 3) return false;
  const at::Tensor* x = door_input(args[0]);
  if (x == nullptr || !PyLong_CheckExact(args[1]) || !PyLong_CheckExact(args[2])) return false;
  int overflow = 0;
  long long dim = PyLong_AsLongLongAndOverflow(args[1], &overflow);
  if (overflow != 0 || (dim != -1 && dim != x->dim() - 1)) return false;
  long long op = PyLong_AsLongLongAndOverflow(args[2], &overflow);
  if (overflow != 0 || (op != SOFTMAX && op != LOG_SOFTMAX)) return false;
  train = grad_mode && x->requires_grad();
  k = door_key(op, train, *x);
  in[0] = *x;
  n_in = 1;
  return true;
}

// door(x, dim, op): softmax (op 0) / log_softmax (op 1); door(op, x, normalized_shape, weight, bias,
// eps): layer_norm (op 2) / rms_norm (op 3). -> the op's output from a recorded plan, or None where
// none serves the call as it is (the caller's Python path then serves it)
PyObject* door(PyObject*, PyObject* const* args, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  DoorState& d = door_state();
  if (d.runtime == nullptr || d.entries.empty()) Py_RETURN_NONE;
  std::vector<int64_t> k;
  std::array<at::Tensor, 4> in;
  bool train = false;
  size_t n_in = 0;
  if (!door_args(args, n, at::GradMode::is_enabled(), k, in, n_in, train) || !door_quiet()) Py_RETURN_NONE;
  auto found = d.entries.find(k);
  if (found == d.entries.end()) Py_RETURN_NONE;
  DoorEntry entry = found->second;  // a copy: a replay that runs Python may change the map
  return serve(entry, train, in, n_in);
  END_HANDLE_TH_ERRORS
}

PyMethodDef door_def = {"door", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(door)), METH_FASTCALL,
                        "door(x, dim, op) (softmax 0, log_softmax 1) or door(op, x, normalized_shape, weight, "
                        "bias, eps) (layer_norm 2, rms_norm 3) -> the output from a recorded plan, or None"};

// door_put(made, *args): `made` (a recorded inference Program, or a training Spec of `n_inputs` inputs)
// serves the calls door(*args) keys like these arguments, in grad mode for a Spec and not for a Program
void door_put(DoorEntry entry, int64_t n_inputs, bool one_output, const py::args& args) {
  std::vector<PyObject*> a;
  for (auto arg : args) a.push_back(arg.ptr());
  bool spec = static_cast<bool>(entry.spec);
  std::vector<int64_t> k;
  std::array<at::Tensor, 4> in;
  size_t n_in = 0;
  bool wanted = false;
  NK_CHECK(door_args(a.data(), static_cast<Py_ssize_t>(a.size()), spec, k, in, n_in, wanted) && wanted == spec,
              "normkit native: an entry for arguments the door does not serve (a contiguous CUDA tensor of one "
              "or more dims; the call's gradient wanted for a Spec, not for a Program)");
  NK_CHECK(n_inputs == static_cast<int64_t>(n_in) && one_output,
           "normkit native: a %s of %lld inputs for a call of %zu inputs (and one output)", spec ? "Spec" : "Program",
           static_cast<long long>(n_inputs), n_in);
  door_state().entries[k] = std::move(entry);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "normkit's native host path for CUDA plans (backends/cuda/native.py)";
  py::class_<Program, c10::intrusive_ptr<Program>>(m, "Program")
      .def("__call__", [](const Program& p, std::vector<std::optional<at::Tensor>> inputs) {
        std::vector<at::Tensor> in;
        for (auto& t : inputs) in.push_back(t.has_value() ? *t : at::Tensor());
        return p.run(in);
      });
  m.def("program", &make_program, "A program from native.py's recorded allocations, launches and outputs");
  py::class_<Spec, c10::intrusive_ptr<Spec>>(m, "Spec")
      .def("set_backward", [](Spec& s, int64_t variant, c10::intrusive_ptr<Program> p) {
        // its inputs: the incoming gradients, then the saved tensors; its outputs: one per forward input
        NK_CHECK(p->n_inputs == static_cast<int64_t>(s.grad_dtypes.size() + s.saved.size()),
                 "normkit native: a backward program of %lld inputs for %zu gradients and %zu saved tensors",
                 static_cast<long long>(p->n_inputs), s.grad_dtypes.size(), s.saved.size());
        NK_CHECK(p->outputs.size() == static_cast<size_t>(s.forward->n_inputs),
                 "normkit native: a backward program of %zu outputs for %lld inputs", p->outputs.size(),
                 static_cast<long long>(s.forward->n_inputs));
        std::lock_guard<std::mutex> hold(s.lock);
        s.backward.at(variant) = p;
      });
  m.def("spec", [](c10::intrusive_ptr<Program> forward, std::vector<int64_t> returned, std::vector<int64_t> saved,
                   py::list grad_dtypes, py::object slow) {
    NK_CHECK(forward->n_inputs <= static_cast<int64_t>(kMaxInputs), "normkit native: at most %zu inputs",
             static_cast<size_t>(kMaxInputs));
    auto n_out = static_cast<int64_t>(forward->outputs.size());
    for (int64_t r : returned) {
      NK_CHECK(0 <= r && r < n_out, "normkit native: returned output %lld of %lld", static_cast<long long>(r),
               static_cast<long long>(n_out));
    }
    for (int64_t v : saved) {
      NK_CHECK(v >= 0 ? v < forward->n_inputs : -1 - v < n_out,
               "normkit native: saved tensor %lld of %lld inputs and %lld outputs", static_cast<long long>(v),
               static_cast<long long>(forward->n_inputs), static_cast<long long>(n_out));
    }
    auto s = c10::make_intrusive<Spec>();
    s->forward = forward;
    s->returned = std::move(returned);
    s->saved = std::move(saved);
    for (auto d : grad_dtypes) s->grad_dtypes.push_back(torch::python::detail::py_object_to_dtype(
        py::reinterpret_borrow<py::object>(d)));
    s->slow = slow.release().ptr();
    return s;
  });
  m.def("apply", [](c10::intrusive_ptr<Spec> spec, std::vector<Opt> inputs) {
    NK_CHECK(inputs.size() <= kMaxInputs, "normkit native: at most %zu inputs", static_cast<size_t>(kMaxInputs));
    inputs.resize(kMaxInputs);
    return Node::apply(spec, inputs[0], inputs[1], inputs[2], inputs[3], inputs[4]);
  });
  // the door: set up once (where launch hooks and the tests' RECORD live), entries per recorded plan
  m.def("door_setup", [](py::object runtime, py::object launch) {
    DoorState& d = door_state();
    if (d.runtime == nullptr) {
      d.enter = PyUnicode_InternFromString("launch_enter_hook");
      d.leave = PyUnicode_InternFromString("launch_exit_hook");
      d.calls = PyUnicode_InternFromString("calls");
      d.record = PyUnicode_InternFromString("RECORD");
    }
    Py_XDECREF(d.runtime);
    Py_XDECREF(d.launch);
    d.runtime = runtime.release().ptr();
    d.launch = launch.release().ptr();
  });
  m.def("door_put", [](c10::intrusive_ptr<Program> p, const py::args& args) {
    door_put({p, {}}, p->n_inputs, !p->outputs.empty(), args);
  });
  m.def("door_put", [](c10::intrusive_ptr<Spec> s, const py::args& args) {
    door_put({{}, s}, s->forward->n_inputs, s->returned.size() == 1, args);
  });
  m.def("door_clear", [] { door_state().entries.clear(); });
  m.def("door_size", [] { return door_state().entries.size(); });
  m.add_object("door", py::reinterpret_steal<py::object>(PyCFunction_New(&door_def, nullptr)));
}
