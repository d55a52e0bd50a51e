"""Drafters that ship with the package. `default_drafter_dir()` is the DFlash drafter trained by the project for
SmolLM2-135M-Instruct (see its model card, MODEL_CARD.md in the same folder), or None if this build has none."""

from __future__ import annotations

from pathlib import Path

SMOLLM2_DRAFTER = "smollm2-135m-instruct-dflash"


def default_drafter_dir() -> Path | None:
    path = Path(__file__).parent / SMOLLM2_DRAFTER
    return path if (path / "config.json").exists() else None
