"""The tree attention kernel's launches: one compiled variant for every context split count.

Triton compiles a kernel once per combination of argument dtypes and constexprs (the step-varying integers are
unspecialized, `triton_jit.jit_unspecialized`). With unused pointer arguments standing in as the output's dtype,
a step whose context split in two compiled the kernel a second time while serving (vLLM's JIT monitor on the
H200, session 30). Here the launches are recorded instead of run, so this checks the arguments on the CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.gpu.cases import make_case  # noqa: E402
from vllm_ddtree.attention import triton_tree  # noqa: E402


class RecordedLaunches:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))

        return launch


def _signature(args, kwargs) -> tuple:
    """What Triton keys a compiled kernel on, less the integers left unspecialized: tensor dtypes, constexprs."""
    dtypes = tuple(str(a.dtype) if isinstance(a, torch.Tensor) else "scalar" for a in args)
    return dtypes, tuple(sorted(kwargs.items()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_split_count_launches_the_same_kernel(monkeypatch, dtype):
    attention, merge = RecordedLaunches(), RecordedLaunches()
    monkeypatch.setattr(triton_tree, "_tree_attention_kernel", attention)
    monkeypatch.setattr(triton_tree, "_merge_splits_kernel", merge)
    case = make_case(2, 17, 700, 8, 2, 64, dtype, "cpu", seed=3)  # B = 17: a width unlike any block size
    t = case.tree
    for num_splits in (1, 2, 7):
        out = torch.empty_like(case.query)
        triton_tree.tree_attention_triton_(
            case.query, case.kv.keys, case.kv.values, t.block_table, t.query_start, t.seq_lens, t.num_nodes,
            t.node_mask, t.max_seq_len, case.scale, out, num_splits=num_splits,
        )  # fmt: skip
    grids = [grid for grid, _, _ in attention.launches]
    assert [g[2] for g in grids] == [1, 2, 7]  # the split count is the grid's third dimension
    signatures = {_signature(args, kwargs) for _, args, kwargs in attention.launches}
    assert len(signatures) == 1, signatures
    assert len(merge.launches) == 2  # the two split launches merge; one split writes the output itself
    assert len({_signature(args, kwargs) for _, args, kwargs in merge.launches}) == 1
