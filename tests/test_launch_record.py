"""ci/launch_record.py: the CUDA backend's launches recorded without a GPU (the check that a
refactor of backends/cuda launches what it launched before)."""

import importlib.util
import pathlib

import pytest
import torch

from normkit.backends.cuda import config

_PATH = pathlib.Path(__file__).resolve().parents[1] / "ci" / "launch_record.py"
_spec = importlib.util.spec_from_file_location("launch_record", _PATH)
launch_record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch_record)

GRID = dict(dtypes=(torch.bfloat16, torch.float32), row_ns=(256, 16384, 40999, 131072),
            images=((2, 6, 9, 3),))  # fmt: skip


@pytest.fixture(scope="module")
def recorded():
    return launch_record.record(**GRID)


def test_every_call_launches_and_the_record_repeats(recorded):
    calls = launch_record._by_call(recorded)
    assert all(len(launches) > 1 for launches in calls.values())  # the call, then launches or "(no plan)"
    assert launch_record.record(**GRID) == recorded
    # the paths the grid reaches: fused rows, split rows, rows in shared memory, the images
    kernels = {line.split()[0] for line in recorded if not line.startswith("==")}
    reached = {"layer_norm._fwd_fused_kernel", "layer_norm._fwd_split_kernel", "layer_norm._bwd_smem_kernel",
               "layer_norm._bwd_split_kernel", "group_norm._fwd_fused_kernel", "batch_norm._apply_kernel"}
    assert reached <= kernels


def test_a_changed_heuristic_shows(recorded):
    with config.forced(fused_max_n_fwd=128):  # rows of 256 leave the fused forward
        changed = launch_record.record(**GRID)
    old, new = launch_record._by_call(recorded), launch_record._by_call(changed)
    differ = {call.split()[1] for call in new if new[call] != old[call]}
    assert {"layer_norm_fwd", "rms_norm_fwd", "softmax_fwd"} <= differ
    assert "layer_norm_bwd" not in differ  # the backward has its own limit
    same = "== layer_norm_fwd bfloat16 3x40999"  # past the fused limit already: split rows either way
    assert new[same] == old[same]
