# Sourced by the scripts/gpu_*.sh device calls: vLLM 0.26 from the staged bundle, and the plugin registered
# without pip (`pip install -e .` failed on the device machine, 2026-11-29): the repository goes on PYTHONPATH
# and a minimal dist-info in /tmp/site declares the vllm.general_plugins entry point.
source /tmp/site/env.sh
d=/tmp/site/vllm_ddtree-0.1.0.dist-info
mkdir -p "$d"
printf "Metadata-Version: 2.1\nName: vllm-ddtree\nVersion: 0.1.0\n" > "$d/METADATA"
printf "[vllm.general_plugins]\nddtree = vllm_ddtree:register\n" > "$d/entry_points.txt"
export PYTHONPATH="$PWD:$PYTHONPATH"
# TP runs: plain NCCL all-reduce, no NVLink multicast (the device machines ask for that; see tests/e2e/test_tensor_parallel.py).
export VLLM_ALLREDUCE_USE_SYMM_MEM=0 VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm
# The shipped drafter: the repository's, or the copy gpu_stage_data.sh staged when the tree left its weights out
# (scripts/gpu_lean_tree.sh). The device scripts default to it; INIT_FROM=shipped in gpu_train.sh.
SHIPPED_DRAFTER=vllm_ddtree/drafters/smollm2-135m-instruct-dflash
[ -f "$SHIPPED_DRAFTER/model.safetensors" ] || SHIPPED_DRAFTER=/tmp/shipped-drafter
export SHIPPED_DRAFTER
