"""DFlash drafter training: a pure-torch drafter that saves in vLLM's DFlashDraftModel layout (model.py), prompt
data with a fixed held-out split (data.py) and the training loop on the target's own responses (train.py)."""

from vllm_ddtree.drafter.model import DFlashDrafter, DrafterConfig

__all__ = ["DFlashDrafter", "DrafterConfig"]
