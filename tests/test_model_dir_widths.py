"""A model directory takes checkpoints of its architecture whose widths differ from its
source's in ways transformers allows: a head width other than ``hidden_size /
num_attention_heads`` (``head_dim`` given), a KV head count other than the source's. Its
record's shape rules read ``head_dim`` and ``num_key_value_heads`` there (the scaffold's probe
breaks those coincidences, resin.scaffold.tiny_checkpoint.shape_probe_config); a rule bound to
``hidden_size``, ``intermediate_size * num_key_value_heads`` or (Qwen3-Next's k / v)
``shared_expert_intermediate_size`` refused such checkpoints at load, before any forward
(found by building checkpoints with transformers, 2026-12-07).

Each checkpoint: the directory's tiny config with the change, random weights from
transformers' own model class (resin.scaffold.tiny_checkpoint.reinit_weights), the tiny's
tokenizer; parity's layers and logits stages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.model_variants import built_checkpoint, model_parity

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parent.parent / "resin" / "models"
CASES = [
    ("olmo2", {"head_dim": 32}),
    ("cohere2", {"head_dim": 32}),
    ("starcoder2", {"head_dim": 32}),
    ("glm4", {"head_dim": 32}),
    ("glm4", {"num_key_value_heads": 1}),
    ("granite", {"head_dim": 24, "num_key_value_heads": 1}),
    # its record bound k / v to shared_expert_intermediate_size (2 x 256 = 512 in the source)
    ("qwen3_next", {"num_key_value_heads": 1}),
]


def checkpoint(name: str, changes: dict[str, Any], out: Path) -> Path:
    tiny = MODELS / name / "tiny"
    return built_checkpoint(
        tiny, out, {**json.loads((tiny / "config.json").read_text()), **changes}
    )


@pytest.mark.parametrize("name,changes", CASES, ids=lambda c: str(c))
def test_the_record_takes_other_head_widths_and_kv_counts(
    tmp_path: Path, name: str, changes: dict[str, Any]
) -> None:
    path = checkpoint(name, changes, tmp_path / name)
    report = model_parity(MODELS / name, checkpoint=path, layers_only=True)
    assert report.passed, report.summary()
