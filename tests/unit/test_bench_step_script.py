"""scripts/bench_step.py: DDTree's bookkeeping kernels per step from a torch profile, its phase table and its
Python profile."""

from types import SimpleNamespace

import pytest

from test_benchmark_script import load_script


def load_bench_step():
    return load_script("bench_step.py")  # it sets vLLM's in-process switch for itself, undone for later tests


def test_bookkeeping_kernels_are_summed_per_step_apart_from_the_rest():
    bench = load_bench_step()

    def event(key, device, us):
        return SimpleNamespace(key=key, device_type=f"DeviceType.{device}", self_device_time_total=us)

    averages = [
        event("_walk_kernel", "CUDA", 40.0),
        event("_tree_step_layout_kernel", "CUDA", 80.0),
        event("_tree_attention_kernel", "CUDA", 1000.0),  # verification, not bookkeeping
        event("sm90_xmma_gemm_bf16", "CUDA", 6000.0),
        event("aten::mm", "CPU", 500.0),  # host ops are not kernels
    ]
    got = bench.kernel_times_per_step(averages, steps=8)
    assert got["all_kernels_us"] == (40 + 80 + 1000 + 6000) / 8
    assert got["bookkeeping_us"] == (40 + 80) / 8
    assert got["bookkeeping_kernels_us"] == {"_tree_step_layout_kernel": 10.0, "_walk_kernel": 5.0}


def test_the_chain_drafts_its_own_count_while_ddtree_takes_the_budget():
    """A B = 64 DDTree profile against the chain of 15 drafts (a DFlash drafter of block 16 drafts at most 15)."""
    spec_for = load_bench_step().spec_for

    assert spec_for("ddtree", "D", 64, chain_tokens=15)["num_speculative_tokens"] == 64
    assert spec_for("dflash", "D", 64, chain_tokens=15)["num_speculative_tokens"] == 15
    assert spec_for("dflash-v1", "D", 64, chain_tokens=15) == {"method": "dflash", "model": "D",
                                                                "num_speculative_tokens": 15}
    assert spec_for("dflash", "D", 15)["num_speculative_tokens"] == 15  # default: the budget
    assert spec_for("none", "D", 64, chain_tokens=15) is None
    assert spec_for("ddtree-ingraph-v2", "D", 64, chain_tokens=15) == {
        "method": "ddtree", "model": "D", "num_speculative_tokens": 64, "tree_in_graph": True}
    assert spec_for("ddtree-ingraph-layoutgraph", "D", 8)["layout_in_graph"] is True
    with pytest.raises(ValueError, match="unknown method 'ddtree-B8'"):
        spec_for("ddtree-B8", "D", 8)


def test_every_verification_step_of_the_profile_gets_a_full_graph_size(tmp_path):
    """Session 21: with powers of two alone, B = 64 at batch 1 (65 tokens) fell to the 128 bucket and ran piecewise.
    The sizes must hold r x (B + 1) for every request count r, and the drafter's block x max_num_seqs."""
    bench = load_bench_step()
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text('{"block_size": 16}')

    sizes = bench.graph_capture_sizes(bench.spec_for("ddtree", str(drafter), 64), 4, str(drafter))
    assert {65, 130, 195, 260} <= set(sizes)
    assert 16 * 4 in sizes
    chain = bench.graph_capture_sizes(bench.spec_for("dflash", str(drafter), 64, chain_tokens=15), 1, str(drafter))
    assert 16 in chain
    assert bench.graph_capture_sizes(None, 8, str(drafter))  # no speculation: powers of two for prefills
    assert bench.graph_capture_sizes(None, 8, None) == bench.graph_capture_sizes(None, 8, str(drafter))


def test_phase_table_puts_the_methods_phases_side_by_side_in_step_order():
    bench = load_bench_step()
    rows = [
        {"method": "ddtree", "batch": 4, "profile": {"host_ms": {"vllm_prepare_inputs": 0.5, "tree_layout": 0.1,
                                                                 "draft": 1.0}}},
        {"method": "dflash", "batch": 4, "profile": {"host_ms": {"vllm_prepare_inputs": 0.4,
                                                                 "rejection_sampler": 0.3, "draft": 0.9}}},
        {"method": "ddtree", "batch": 1, "profile": {"host_ms": {"draft": 1.0}}},  # no chain at batch 1: no table
    ]  # fmt: skip
    lines = bench.phase_table(rows).splitlines()
    assert lines[1:3] == ["batch 4, host_ms per step:", "| phase | ddtree | dflash |"]
    assert lines[4:] == [
        "| vllm_prepare_inputs | 0.500 | 0.400 |",
        "| tree_layout | 0.100 | - |",
        "| rejection_sampler | - | 0.300 |",
        "| draft | 1.000 | 0.900 |",
        "| total | 1.600 | 1.600 |",
    ]
    assert bench.phase_table(rows, "gpu_ms") == ""


def test_python_profile_splits_own_time_between_the_plugin_vllm_and_the_rest(tmp_path):
    """`--python-profile`: cProfile's own time per step, the plugin's functions (files under vllm_ddtree/) apart
    from vLLM's; the table names the functions."""
    import time

    import torch

    from vllm_ddtree.tree import walk_tree  # a plugin function

    bench = load_script("bench_step.py")

    def run():  # returns the decode steps it ran, as bench_step's runs do
        for _ in range(4):
            walk_tree(torch.tensor([[5, 6]]), torch.tensor([[-1, 0]]), torch.tensor([[0, 1]]),
                      torch.tensor([[6, 7]]), torch.tensor([2]), 1)
        deadline = time.perf_counter() + 0.02
        while time.perf_counter() < deadline:  # own time outside both packages
            pass
        return 2

    own = bench.python_profile(run, path=tmp_path / "python.txt")
    assert own["vllm_ddtree"] > 0 and own["vllm"] == 0
    assert own["all"] >= own["vllm_ddtree"] + 10  # the 20 ms loop over 2 steps counts in "all" only
    text = (tmp_path / "python.txt").read_text()
    assert "walk_tree" in text and "own ms per step" in text


def test_decode_steps_count_drafts_per_request_for_speculative_methods():
    bench = load_bench_step()
    assert bench.decode_steps("none", 4, 16, 0) == 16
    assert bench.decode_steps("ddtree", 4, 16, 20) == 5  # 20 drafts over 4 requests: 5 verification steps
    assert bench.decode_steps("dflash", 4, 16, 0) == 1  # at least one
