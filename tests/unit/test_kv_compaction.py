"""`kv.compact`'s per-runner caches (the layer grouping), without a GPU."""


def test_compaction_keeps_the_layer_grouping_per_runner():
    """`compact_accepted_kv_` groups the layers once per layers dict when given a runner's `tables` (the loop over
    every layer ran each step), and a different dict gets its own grouping."""
    from types import SimpleNamespace

    from vllm_ddtree.kv.compact import _layer_groups

    layers = {f"l{i}": SimpleNamespace(name=i) for i in range(4)}
    layer_groups = {"l0": 0, "l1": 1, "l2": 0, "l3": 1}
    tables: dict = {}
    first = _layer_groups(layers, layer_groups, tables)
    assert [(gid, [layer.name for layer in group]) for gid, group in first] == [(0, [0, 2]), (1, [1, 3])]
    assert _layer_groups(layers, layer_groups, tables) is first
    other = {"l0": layers["l0"]}
    assert [(gid, len(group)) for gid, group in _layer_groups(other, None, tables)] == [(0, 1)]
    assert _layer_groups(layers, None, None) is not first  # without tables: built each call
