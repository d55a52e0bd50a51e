"""Target models that the project builds offline from PyPI packages."""

from vllm_ddtree.models.smollm2 import convert_smollm2, ddtree_home, default_smollm2_dir

__all__ = ["convert_smollm2", "ddtree_home", "default_smollm2_dir"]
