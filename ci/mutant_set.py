"""The mutants of ci/mutants.py: one realistic bug each, with the tests that must catch it.

Grouped by what they mutate: the front end (normkit/), the CPU path, the reference (which is also
the CPU backend), the kernels' shared helpers (backends/common.py), the NPU kernels and the CUDA
kernels. ``device="cpu"`` mutants run under CI (the interpreter executors and the CPU suite);
``device="cuda"`` ones reach code that only runs on a GPU (split rows, shared memory, plans, the
launcher) and run with ``--device cuda`` on a GPU machine.
"""

from mutants import Mutant

LN = "tests/test_layer_norm.py"
SM = "tests/test_softmax.py"
ADD = "tests/test_add_norm.py"
NPU_I = "npu-kernels-interpreter"
CUDA_I = "cuda-kernels-interpreter"


_ROWS_KEY = "key = tl.broadcast_to(row_key(seed, rows)[:, None], (ROWS, WIDTH))"
_ONE_KEY = "key = tl.broadcast_to(row_key(seed, 0 * rows)[:, None], (ROWS, WIDTH))"


def _k(*words: str) -> tuple[str, str]:
    return "-k", " and ".join(words)


def _gpu(path: str, *words: str) -> tuple[str, ...]:
    """pytest arguments: the tests of ``path`` marked cuda that match every -k term of ``words``."""
    return path, "-m", "cuda", *_k(*words)


MUTANTS = [
    # --- front end ---------------------------------------------------------------------------------
    Mutant("functional-layer_norm-ignores-eps", "normkit/functional.py", "layer_norm",
           '"layer_norm", input, normalized_shape, eps, torch_dtypes=True',
           '"layer_norm", input, normalized_shape, 1e-5, torch_dtypes=True',
           (LN, *_k("test_matches_reference", CUDA_I)), what="every LayerNorm uses eps = 1e-5"),
    Mutant("functional-rms_norm-rounds-fp32-weight", "normkit/functional.py", "rms_norm",
           '    key = plans.key("rms_norm", input, (weight,)',
           '    weight = weight if weight is None else weight.to(input.dtype)\n'
           '    key = plans.key("rms_norm", input, (weight,)',
           (LN, *_k("fp32_weight", CUDA_I)),
           what="an fp32 RMSNorm weight rounded to a 16-bit input's dtype"),
    Mutant("functional-softmax-wrong-dim-back", "normkit/functional.py", "_softmax",
           "y if last else y.movedim(-1, dim)", "y if last else y.movedim(-1, 0)",
           (SM, *_k("test_any_dim", CUDA_I)), what="a non-last dim's result moved back to dim 0"),
    Mutant("functional-softmax-key-ignores-dim", "normkit/functional.py", "softmax_key",
           "    if dim != -1 and dim != input.dim() - 1:\n        return None\n", "",
           ("tests/test_api.py", *_k("serves_only_its_dim")),
           what="a softmax along dim 0 served by the plan remembered for the last dim"),
    Mutant("functional-add-norm-prenorm-returns-y", "normkit/functional.py", "_add_norm",
           "    y, h = _shaped(y, x), _shaped(h, x)\n    return (y, h) if prenorm else y",
           "    y, h = _shaped(y, x), _shaped(h, x)\n    return (y, y) if prenorm else y",
           (ADD, *_k("test_matches_reference", CUDA_I)), what="prenorm=True returns y for h"),
    Mutant("plans-contract-backward-loses-overrides", "normkit/plans.py", "_Restored.restored",
           "if self.overrides is dispatch.overrides():", "if True:",
           ("tests/test_api.py", "-k", "contract_plan_backward"),
           what="a contract plan's backward runs under the backward thread's overrides, not the forward's"),
    Mutant("plans-contract-plans-not-remembered", "normkit/plans.py", "make",
           "        _PLANS[key] = plan\n", "        _PLANS[key] = None if is_contract(plan) else plan\n",
           ("tests/test_api.py", "-k", "remembered_contract_plans"),
           what="contract plans are made again for every call: repeated calls run the checks again"),
    # --- the native extension (backends/cuda/native.cpp, normkit/native_cpu.cpp; CPU tests build it, ~1 min)
    Mutant("native-node-gradient-not-viewed", "backends/cuda/native.cpp", "",
           "if (g.sizes() != c10::IntArrayRef(want)) g = g.view(want);", "(void)want;",
           ("tests/test_native.py", *_k("python_backward_until")),
           what="the C++ node returns a program's (M, N) gradient without viewing it to the input's shape"),
    Mutant("native-cpu-layer-norm-dx-drops-c2", "normkit/native_cpu.cpp", "",
           "dx[k] = C::store(rstd * (d * W[k] - xhat * c1 - c2));",
           "dx[k] = C::store(rstd * (d * W[k] - xhat * c1));",
           ("tests/test_cpu.py", *_k("16bit_layer_norm_gradients", "native", "1151x1024", "none")),
           what="the native CPU LayerNorm's dx without its mean term"),
    # --- the CPU path (torch's operators) -------------------------------------------------------------
    Mutant("cpu-serves-nothing", "normkit/cpu.py", "serves",
           "return type(input) is torch.Tensor and input.is_cpu and not dispatch._IN_OVERRIDE[0]",
           "return False",
           ("tests/test_cpu.py", "-k", "row_norms"),
           what="every CPU call takes normkit's full path (the reference) instead of torch's operators"),
    Mutant("cpu-add-norm-drops-residual", "normkit/cpu.py", "add_norm",
           "h = x + residual  # the common call's h", "h = x + 0 * residual  # the common call's h",
           ("tests/test_cpu.py", "-k", "add_norms"), what="h = x: the residual dropped"),
    Mutant("cpu-layer-norm-drops-bias", "normkit/cpu.py", "_layer_norm",
           "return torch.layer_norm(input, shape, weight, bias, eps)",
           "return torch.layer_norm(input, shape, weight, None, eps)",
           ("tests/test_cpu.py", "-k", "row_norms"), what="LayerNorm on CPU without its bias"),
    Mutant("cpu-batch-norm-eval-statistics", "normkit/cpu.py", "batch_norm",
           "running_var, training, momentum,\n                                        eps, False)",
           "running_var, False, momentum,\n                                        eps, False)",
           ("tests/test_cpu.py", "-k", "batch_norm"),
           what="training BatchNorm normalizes by the running statistics"),
    Mutant("cpu-16bit-layer-norm-grads-by-torch", "normkit/cpu.py", "_layer_norm",
           "if input.dtype in _HALF and _differentiated(input, weight, bias):", "if False:",
           ("tests/test_cpu.py", "-k", "row_norms and layer_norm or 16bit_layer_norm"),
           what="16-bit LayerNorm gradients from torch's 16-bit CPU backward"),
    Mutant("cpu-16bit-layer-norm-16bit-statistics", "normkit/cpu.py", "_HalfLayerNorm.forward",
           "y, mean, rstd = torch.native_layer_norm(x, shape, w32, _f32(bias), eps)",
           "y, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)",
           ("tests/test_cpu.py", "-k", "16bit_layer_norm"),
           also=(("_HalfLayerNorm.backward", "mean2, rstd2 = mean.reshape(-1, 1), rstd.reshape(-1, 1)",
                  "mean2, rstd2 = mean.reshape(-1, 1).float(), rstd.reshape(-1, 1).float()"),),
           what="16-bit LayerNorm statistics saved in 16-bit (torch's operator with 16-bit parameters)"),
    Mutant("cpu-16bit-layer-norm-dweight-last-chunk-only", "normkit/cpu.py", "_HalfLayerNorm.backward",
           "dw32 = gw if dw32 is None else dw32.add_(gw)", "dw32 = gw",
           ("tests/test_cpu.py", "-k", "16bit_layer_norm"),
           what="16-bit LayerNorm dweight from the last chunk of rows only"),
    Mutant("cpu-16bit-layer-norm-last-chunk-dropped", "normkit/cpu.py", "_HalfLayerNorm.backward",
           "for i in range(0, x2.shape[0], step):", "for i in range(0, x2.shape[0] - step, step):",
           ("tests/test_cpu.py", "-k", "16bit_layer_norm"),
           what="16-bit LayerNorm dweight / dbias without the last chunk of rows"),
    Mutant("cpu-16bit-group-norm-grads-by-torch", "normkit/cpu.py", "group_norm",
           "if input.dtype in _HALF and _differentiated(input, weight, bias):", "if False:",
           ("tests/test_cpu.py", "-k", "test_group_norm or 16bit_group_norm"),
           what="16-bit GroupNorm gradients from torch's CPU backward"),
    # --- the reference (the CPU backend, and the tests' oracle) -----------------------------------------
    Mutant("reference-momentum-inverted", "normkit/reference.py", "update_running_stats",
           "running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)",
           "running_mean.mul_(momentum).add_(mean.to(running_mean.dtype), alpha=1 - momentum)",
           ("tests/test_batch_norm.py", "tests/test_torch_parity.py", "-k", "batch_norm or running"),
           what="running mean = momentum * running + (1 - momentum) * batch"),
    Mutant("reference-running-var-biased", "normkit/reference.py", "update_running_stats",
           "unbiased = (var * (count / (count - 1)))", "unbiased = (var * 1.0)",
           ("tests/test_batch_norm.py", "tests/test_torch_parity.py", "-k", "batch_norm or running"),
           what="the running variance takes the biased batch variance"),
    Mutant("reference-log-softmax-bwd-sign", "normkit/reference.py", "softmax_bwd",
           "dx = dyf - torch.exp(yf) * dyf.sum(dim=1, keepdim=True)",
           "dx = dyf + torch.exp(yf) * dyf.sum(dim=1, keepdim=True)",
           ("tests/test_torch_parity.py", "-k", "softmax"), what="log_softmax's backward with a + sign"),
    # --- kernels' shared helpers (both backends) --------------------------------------------------------
    Mutant("common-online-max-no-rescale", "backends/common.py", "online_max_sum",
           "s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)",
           "s = s + tl.sum(tl.exp(x - shift), axis=0)",
           (SM, *_k("test_matches_reference", "40999")),
           what="the running sum is not rescaled to a new max"),
    Mutant("common-chan-merge-wrong-weight", "backends/common.py", "chan_merge",
           "mean = mean + delta * (count / total)", "mean = mean + delta * (seen / total)",
           (LN, *_k("test_matches_reference", NPU_I, "layer_norm")),
           what="Chan's merge weighs the old mean"),
    Mutant("common-dropout-unscaled", "backends/common.py", "residual_add",
           "x = tl.where(_keep(key, cols, p), x * scale, 0.0)",
           "x = tl.where(_keep(key, cols, p), x, 0.0)",
           (ADD, *_k("interpreter", "dropout")), what="kept elements not scaled by 1 / (1 - p)"),
    Mutant("common-group-norm-cl-transposed", "backends/common.py", "group_norm_at",
           "return base + (j // Cg) * C + j % Cg, j % Cg", "return base + (j % Cg) * C + j // Cg, j % Cg",
           ("tests/test_layouts.py", *_k("interpreter", "group_norm")),
           what="a channels-last group read with position and channel swapped"),
    # --- NPU kernels (under the interpreter) ------------------------------------------------------------
    # the looped row bodies both backends share (backends/common.py), killed through the NPU kernels
    Mutant("common-looped-eps-outside-sqrt", "backends/common.py", "row_norm_fwd_tiles",
           "rstd = 1.0 / tl.sqrt(m2 * inv_n + eps)", "rstd = 1.0 / (tl.sqrt(m2 * inv_n) + eps)",
           (LN, *_k("test_matches_reference", NPU_I)), what="1 / (sqrt(var) + eps)"),
    Mutant("common-looped-dropout-one-key", "backends/common.py", "row_norm_fwd_tiles",
           "key = row_key(seed, row)", "key = row_key(seed, 0 * row)",
           (ADD, *_k(NPU_I, "documented_formula")), also=(("row_norm_bwd_tile", "row_key(seed, row)",
                                                 "row_key(seed, 0 * row)"),),
           what="every row's dropout mask drawn from one key (forward and backward alike)"),
    Mutant("npu-row-chunks-drop-tail", "backends/npu/config.py", "row_chunks",
           "chunks = -(-M // per_chunk) if M else 0", "chunks = M // per_chunk if M else 0",
           (LN, *_k("test_matches_reference", NPU_I)),
           what="the backward's last, short row chunk skipped"),
    Mutant("common-looped-bwd-drops-c2", "backends/common.py", "row_norm_bwd_tile",
           "dx = (wdy - (xhat * tl.load(C1 + row) + tl.load(C2 + row))) * rstd",
           "dx = (wdy - xhat * tl.load(C1 + row)) * rstd",
           (LN, *_k("test_matches_reference", NPU_I, "layer_norm")),
           what="LayerNorm dx without the mean term"),
    Mutant("npu-rows-bwd-drops-c2", "backends/npu/layer_norm.py", "_bwd_rows_kernel",
           "dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]",
           "dx = (wdy - xhat * c1[:, None]) * rstd[:, None]",
           (LN, *_k("test_matches_reference", NPU_I, "layer_norm")),
           what="LayerNorm dx of whole-row tiles without the mean term"),
    Mutant("npu-rows-dropout-one-key", "backends/npu/layer_norm.py", "_fwd_rows_kernel",
           _ROWS_KEY, _ONE_KEY, (ADD, *_k(NPU_I, "documented_formula")),
           also=(("_bwd_rows_kernel", _ROWS_KEY, _ONE_KEY),),
           what="every packed row's dropout mask drawn from one key (forward and backward alike)"),
    Mutant("npu-rows-fwd-unmasked-store", "backends/npu/layer_norm.py", "_fwd_rows_kernel",
           "tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)",
           "tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty))",
           ("tests/test_sentinels.py", *_k(NPU_I, "layer_norm")), what="a packed tile's padding stored"),
    Mutant("npu-softmax-rows-bwd-drops-sum", "backends/npu/softmax.py", "_bwd_rows_kernel",
           "dx = y * (dy - tl.sum(dy * y, axis=1)[:, None])", "dx = y * dy",
           (SM, *_k("test_matches_reference", NPU_I, "softmax")),
           what="softmax dx of rows held in UB without the row's dot product"),
    Mutant("npu-param-sums-swapped", "backends/npu/reduce.py", "param_sums",
           "return sum_partials(dw_part, weight_dtype, db_part, bias_dtype)",
           "return sum_partials(db_part, weight_dtype, dw_part, bias_dtype)",
           (LN, *_k("test_matches_reference", NPU_I, "layer_norm")),
           what="dweight and dbias sums swapped in the one-launch reduction"),
    Mutant("common-looped-fwd-unmasked-store", "backends/common.py", "row_norm_fwd_tiles",
           "tl.store(Y + row64 * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)",
           "tl.store(Y + row64 * stride_y + offs, y.to(Y.dtype.element_ty))",
           ("tests/test_sentinels.py", *_k(NPU_I, "layer_norm")), what="y's last tile stored unmasked"),
    # --- CUDA kernels that run under the interpreter ----------------------------------------------------
    Mutant("cuda-fused-fwd-unmasked-store", "backends/cuda/layer_norm.py", "_fwd_fused_kernel",
           "tl.store(Y + as_col(rows64 * stride_y, ROWS) + cols, y.to(Y.dtype.element_ty), mask=mask)",
           "tl.store(Y + as_col(rows64 * stride_y, ROWS) + cols, y.to(Y.dtype.element_ty))",
           ("tests/test_sentinels.py", *_k(CUDA_I, "layer_norm")), what="y's tile stored unmasked"),
    Mutant("cuda-fused-fwd-eps-outside-sqrt", "backends/cuda/layer_norm.py", "_fwd_fused_kernel",
           "rstd = 1.0 / tl.sqrt(var + exact_eps(eps, eps_lo, ACC))",
           "rstd = 1.0 / (tl.sqrt(var) + exact_eps(eps, eps_lo, ACC))",
           (LN, *_k("test_matches_reference", CUDA_I)), what="1 / (sqrt(var) + eps)"),
    Mutant("cuda-fused-bwd-drops-c2", "backends/cuda/layer_norm.py", "_bwd_fused_kernel",
           "dx = (wdy - (xhat * c1 + c2)) * rstd", "dx = (wdy - xhat * c1) * rstd",
           (LN, *_k("test_matches_reference", CUDA_I, "layer_norm")),
           what="LayerNorm dx without the mean term"),
    Mutant("cuda-fused-fwd-dropout-one-key", "backends/cuda/layer_norm.py", "_fwd_fused_kernel",
           "key = as_col(row_key(seed, rows), ROWS)", "key = as_col(row_key(seed, 0 * rows), ROWS)",
           (ADD, *_k(CUDA_I, "same_on_every")), what="every packed row's dropout mask drawn from one key"),
    Mutant("cuda-fused-bwd-dropout-next-row", "backends/cuda/layer_norm.py", "_bwd_fused_kernel",
           "row_key(seed, rows)[:, None]", "row_key(seed, rows + 1)[:, None]",
           (ADD, *_k(CUDA_I, "same_on_every")), what="the backward regenerates the next row's mask"),
    Mutant("cuda-split-fwd-saves-unshifted-mean", "backends/cuda/layer_norm.py", "_fwd_split_kernel",
           "tl.store(Mean + row, shift + mean)", "tl.store(Mean + row, mean)",
           (LN, *_k("test_matches_reference", CUDA_I, "40999", "layer_norm")),
           what="the split-row forward saves the mean of x - x[0] for the backward"),
    Mutant("cuda-log-softmax-bwd-sign", "backends/cuda/softmax.py", "_bwd_fused_kernel",
           "dx = dy - tl.exp(y) * tl.sum(dy, axis=1)[:, None]",
           "dx = dy + tl.exp(y) * tl.sum(dy, axis=1)[:, None]",
           (SM, *_k("test_matches_reference", CUDA_I, "log_softmax")),
           what="log_softmax's backward with a + sign"),
    # --- GPU only (--device cuda) ------------------------------------------------------------------------
    Mutant("cuda-split-bwd-drops-c2", "backends/cuda/layer_norm.py", "_bwd_split_kernel",
           "dx = (wdy - (xhat * c1 + c2 * inv_n)) * rstd", "dx = (wdy - xhat * c1) * rstd",
           (LN, "-m", "cuda", "-k", "test_matches_reference and 40999 and layer_norm and not npu"),
           device="cuda",
           what="split-row LayerNorm dx without the mean term"),
    Mutant("cuda-split-bwd-dropout-next-row", "backends/cuda/layer_norm.py", "_bwd_split_kernel",
           "row_key(seed, row), cols", "row_key(seed, row + 1), cols",
           (ADD, "-m", "cuda", "-k", "same_on_every and 40999 and not npu"), device="cuda",
           what="the split-row backward regenerates the next row's dropout mask"),
    # Each selection's path on an H100 / H200 (132 SMs, 227 KB of shared memory a block) is noted with
    # it; the tests named assert the path where they can (test_rows_in_shared_memory, the GroupNorm one).
    # One-program rows in shared memory, ONE_PASS (config.smem_row: 40000 = 3 buffers of 16384).
    Mutant("cuda-smem-fwd-welford-old-delta", "backends/cuda/layer_norm.py", "_fwd_smem_kernel",
           "m2 += d * (x - m)", "m2 += d * d",
           _gpu(LN, "test_rows_in_shared_memory", "300", "bfloat16", "not rms_norm"), device="cuda",
           what="the shared-memory forward's Welford update: delta squared (before the mean moved)"),
    # config.smem_backward: aligned 16-bit rows of 12000 (2 buffers of 8192), a training plan's backward.
    Mutant("cuda-smem-bwd-c2-not-averaged", "backends/cuda/layer_norm.py", "_bwd_smem_kernel",
           "c2 = gl.sum(a2, axis=0) * inv_n", "c2 = gl.sum(a2, axis=0)",
           _gpu("tests/test_gpu_hardening.py", "test_training_plans_match_reference", "12000", "bfloat16"),
           device="cuda", what="shared-memory LayerNorm dx takes the row's sum of w * dy for its mean"),
    # config.batch_norm_smem: a channel of 32 x 784 bf16 values in one part (K = 1: not IN_PARTS-gated).
    Mutant("cuda-bn-parts-fwd-drops-shift", "backends/cuda/batch_norm.py", "_fwd_smem_split_kernel",
           "y = (v - shift - mean) * scale + bias", "y = (v - mean) * scale + bias",
           _gpu("tests/test_batch_norm.py", "test_batch_norm_matches_reference", "28", "bfloat16", "train",
                "not npu"), device="cuda",
           what="BatchNorm's forward in parts: x - mean, the mean of x - x[0, c, 0] (shift left out)"),
    # config.softmax: rows of 40999 (not a multiple of 16: no shared memory) in 11 fp32 chunks, 48 row
    # groups (prefetching) of 3 rows or more at M = 128, 1151 (the interpreter's 4 SMs: groups of one row).
    Mutant("cuda-softmax-split-fwd-prefetch-next-row", "backends/cuda/softmax.py", "_fwd_split_kernel",
           "x_next = load_chunk(X, row + groups,", "x_next = load_chunk(X, row + 1,",
           _gpu(SM, "test_matches_reference", "40999", "float32", "not log_softmax", "not npu"),
           device="cuda", what="split-row softmax prefetches row + 1, not its group's next row + groups"),
    # config.batch_norm_split, pipelined by the test: fp32 (3, 300, 9, 15) in 264 channel groups, (64, 16,
    # 56, 56) in 10: groups of two channels (the interpreter's test shapes: one channel a group).
    Mutant("cuda-bn-split-bwd-pipeline-next-channel", "backends/cuda/batch_norm.py", "_bwd_split_kernel",
           "_bwd_split_load(X, DY, c + groups,", "_bwd_split_load(X, DY, c + 1,",
           _gpu("tests/test_gpu_hardening.py", "test_batch_norm_split_and_two_pass_match_reference",
                "pipelined", "float32"), device="cuda",
           what="split-channel BatchNorm backward loads channel c + 1 ahead, not c + groups (pipelined)"),
    # config.group_norm_smem_backward (the test opens its bounds and asserts the kernel ran); dweight is
    # off by mean * sum(dy), and the test's case about a mean of 300 makes that large.
    Mutant("cuda-gn-smem-bwd-uncentered", "backends/cuda/group_norm.py", "_bwd_smem_kernel",
           "gl.sum((x - mean) * dy, axis=1)", "gl.sum(x * dy, axis=1)",
           _gpu("tests/test_group_norm.py", "test_group_norm_backward_rows_in_shared_memory", "200",
                "not bfloat16"), device="cuda",
           what="GroupNorm's shared-memory backward sums x * dy per channel, not (x - mean) * dy"),
    # An aligned then a misaligned call of one shape: the same key, so NORMKIT_CHECK_LAUNCH_KEYS raises.
    Mutant("cuda-launch-key-ignores-alignment", "backends/cuda/launch.py", "tensor_spec",
           "(t.dtype, t.data_ptr() % 16 == 0)", "(t.dtype,)",
           _gpu("tests/test_gpu_hardening.py", "test_direct_launch_never_reuses_another_specialization",
                "float32"), device="cuda",
           what="call-site launch keys hold a tensor's dtype, not its 16-byte alignment"),
    # (1, 40999) then (3, 40999): the second call's training plan is the first's (grid, M of 1 row).
    Mutant("cuda-plan-key-row-length-only", "normkit/plans.py", "key",
           "return (op, input.shape, input.dtype", "return (op, input.shape[-1:], input.dtype",
           _gpu(LN, "test_matches_reference", "40999", "float32", "not rms_norm", "not npu"), device="cuda",
           what="plans keyed by the row length: a plan made for M rows serves inputs of other M"),
]
