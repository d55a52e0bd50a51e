"""The target layers by KV cache group (`attention.layers.layers_by_kv_group`): built once per KV cache, the
list KV compaction walks every step (it regrouped every layer each step before), without a GPU."""

from types import SimpleNamespace


def test_layers_by_kv_group_in_layer_order():
    from vllm_ddtree.attention.layers import layers_by_kv_group

    layers = {f"l{i}": SimpleNamespace(name=i) for i in range(4)}
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["l0", "l2"]),
                                              SimpleNamespace(layer_names=["l3", "l1"])])  # fmt: skip
    groups = layers_by_kv_group(layers, config)
    assert [(gid, [layer.name for layer in group]) for gid, group in groups] == [(0, [0, 2]), (1, [1, 3])]
