"""Checkpoint tensor names -> runner names for glm4_moe (Glm4MoeForCausalLM), where they differ.

Written by hand for the MTP layer (blocks.py "MTP", NOTES.md "MTP"); the stack's tensors keep
their own names minus ``model.``. GLM keeps its next-n layer as the layer past the stack,
``model.layers.{N}.*`` with N = ``num_hidden_layers`` (``MTP_PREFIXES``: already a layer past
the stack, no renaming): its decoder tensors take the stack's names, its own (``eh_proj``,
``enorm``, ``hnorm``, ``shared_head.norm``) reach blocks.mtp_input / mtp_output as the layer's
``mtp`` module.

GLM-4.5 also ships the layer's copies of the shared embedding and head
(``model.layers.{N}.embed_tokens.weight`` = ``model.embed_tokens.weight``,
``model.layers.{N}.shared_head.head.weight`` = ``lm_head.weight``); GLM-4.6 ships neither (vLLM
PR 27597 maps both to the target's). The drafter reads the target's, so the copies are left
unused, not read (two vocab x hidden tensors, 1.55 GB each in bf16 for GLM-4.5):
``IGNORED_PREFIXES`` with ``{layer}`` for any layer index (the next-n layer's index is
``num_hidden_layers``: GLM-4.5 / 4.6: 92, Air: 46, tiny/: 4).
"""

from __future__ import annotations

MTP_PREFIXES = ("model.layers.{layer}.",)

# blocks.MTP_TENSORS: the MTP layer's own tensors
MTP_OWN = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")
WEIGHT_MAP: dict[str, str] = {
    f"model.layers.{{layer}}.{name}": f"layers.{{layer}}.mtp.{name}" for name in MTP_OWN
}

# The MTP layer's copies of the target's embedding and head (module doc): unused. Only a next-n
# layer has such tensors, so a prefix over every layer index leaves nothing else out.
SHARED_COPIES = ("embed_tokens.", "shared_head.head.")
IGNORED_PREFIXES = tuple(f"model.layers.{{layer}}.{name}" for name in SHARED_COPIES)
