#!/usr/bin/env python
"""Pack what drafter training needs on the H200 device machine, which has no network and none of the data packages.

    python scripts/gpu_data.py [--part-mib 31]   # writes .gpu/data/pkgs.tar.xz (prompts, the gguf reader), .gpu/g1..gM

`scripts/gpu_train.sh` unpacks the tarball to /tmp/pkgs and puts it on PYTHONPATH: the folders there mirror the installed
packages' layout (namespace packages holding only the files `vllm_ddtree.drafter.data` and
`vllm_ddtree.models.smollm2` read), so the same code finds them. ShareGPT keeps only each record's id and human
turns (what training reads; the held-out split depends on the id alone). The 98 MB GGUF travels in parts of at
most --part-mib: one device call carries at most 64 MiB, working tree included (the shipped drafter is most of it;
`scripts/gpu_parts.sh` sizes the parts from it); `scripts/gpu_stage_data.sh` joins them.
"""

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_ddtree.drafter import data  # noqa: E402
from vllm_ddtree.models.smollm2 import GGUF_FILE, gguf_path  # noqa: E402


def mirror(source: str, pkgs: Path) -> Path:
    """Destination of a source's data file under ``pkgs``, at the path ``data.package_file`` looks for."""
    package, relative, _ = data._PACKAGE_FILES[source]
    dest = pkgs / package / relative
    dest.parent.mkdir(parents=True, exist_ok=True)
    return dest


def sharegpt_records(prompts) -> list[dict]:
    """The ShareGPT file's records as `data._read_sharegpt` reads them back: each record's id and user turns (the
    first is the prompt; the later ones are `--later-turns` prompts). 4.9 MiB compressed."""
    return [{"id": p.id, "conversations": [{"from": "human", "value": turn} for turn in p.turns]} for p in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--part-mib", type=int, default=31, help="largest GGUF part (MiB)")
    args = parser.parse_args()
    gpu = ROOT / ".gpu"
    pkgs = gpu / "data" / "pkgs"
    shutil.rmtree(gpu / "data", ignore_errors=True)
    mirror("sharegpt", pkgs).write_text(json.dumps(sharegpt_records(data._load_all("sharegpt"))))
    for source in ("mtbench", "humaneval"):
        shutil.copyfile(data.package_file(source), mirror(source, pkgs))
    import gguf

    shutil.copytree(Path(gguf.__file__).parent, pkgs / "gguf", ignore=shutil.ignore_patterns("__pycache__"))
    # transformers asks for gguf's version (importlib.metadata): its dist-info has to travel too.
    dist_info = Path(importlib.metadata.distribution("gguf")._path)
    shutil.copytree(dist_info, pkgs / dist_info.name)
    subprocess.run(["tar", "-C", str(pkgs), "-cJf", str(gpu / "data" / "pkgs.tar.xz"), "."], check=True)
    shutil.rmtree(pkgs)
    blob = gguf_path().read_bytes()
    num_parts = -(-len(blob) // (args.part_mib * 2**20))
    part = -(-len(blob) // num_parts)
    for old in gpu.glob("g[0-9]*"):
        shutil.rmtree(old)
    for i in range(num_parts):
        folder = gpu / f"g{i + 1}"
        folder.mkdir(parents=True)
        (folder / f"{GGUF_FILE}.part{i}").write_bytes(blob[i * part : (i + 1) * part])
        (folder / "COUNT").write_text(f"{num_parts}\n")  # scripts/gpu_stage_data.sh joins once it has them all
    for folder in ("data", *(f"g{i + 1}" for i in range(num_parts))):
        size = sum(f.stat().st_size for f in (gpu / folder).rglob("*") if f.is_file())
        print(f".gpu/{folder}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
