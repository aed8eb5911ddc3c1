"""The public Hugging Face configs the tests ship (tests/spec/configs/*.json), and which of them the
reference model builds."""

from __future__ import annotations

import json
from pathlib import Path

CONFIGS = Path(__file__).parent / "spec" / "configs"
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _dense_decoder_or_encoder(path: Path) -> bool:
    """A config the reference model builds: not encoder-decoder (T5), not a mixture of experts."""
    data = json.loads(path.read_text())
    return data.get("model_type") != "t5" and not any(data.get(key) for key in EXPERT_KEYS)


DENSE = sorted(p.stem for p in CONFIGS.glob("*.json") if _dense_decoder_or_encoder(p))
"""Names of the dense decoder-only and encoder-only configs."""
