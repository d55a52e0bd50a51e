"""vllm-ddtree: DDTree speculative decoding as a vLLM plugin.

vLLM calls `register()` in every process through the `vllm.general_plugins` entry point. It installs two small
hooks: one turns `{"method": "ddtree", ...}` into vLLM's DFlash config plus DDTree settings before vLLM validates
it, the other gives vLLM's model runner the tree proposer, tree verification and KV compaction. Both do nothing
unless a speculative config says "ddtree". Importing this package loads no kernels and no model code.
"""

from __future__ import annotations

__version__ = "0.1.0"

_registered = False


def register() -> None:
    """Entry point of `vllm.general_plugins`; safe to call more than once."""
    global _registered
    if _registered:
        return
    _registered = True
    from vllm_ddtree.compat import unsupported_release
    from vllm_ddtree.engine_hooks import install_config_hook, install_refusal_hook

    reason = unsupported_release()
    if reason is not None:  # a vLLM without the runner DDTree hooks into (0.34): other methods keep working
        install_refusal_hook(reason)
        return
    from vllm_ddtree.metrics import install_metrics
    from vllm_ddtree.requests import install_request_hook
    from vllm_ddtree.runner import install_runner_hooks
    from vllm_ddtree.structured import install_tree_mask_hooks

    install_config_hook()
    install_request_hook()
    install_runner_hooks()
    install_tree_mask_hooks()
    # Both runners' hooks, whatever VLLM_DDTREE_RUNNER says now: the runner is chosen per engine config
    # (`compat.choose_model_runner`), and a process that registered before the variable was set (a benchmark running
    # several methods, a forked engine core) ran vLLM's plain DFlash for DDTree configs on V2 (session 16).
    from vllm_ddtree.runner_v2 import install_v2_runner_hooks

    install_v2_runner_hooks()
    install_metrics()  # tree metrics on /metrics (the API server process; see metrics.py)
