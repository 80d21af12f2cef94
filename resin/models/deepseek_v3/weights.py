"""Checkpoint tensor names for deepseek_v3 (DeepseekV3ForCausalLM) that the record lacks.

Checkpoint names are HF's (no renames). ``architecture.json`` was made from DeepSeek-V3's
config, whose MLA query is low-rank (``q_a_proj -> q_a_layernorm -> q_b_proj``); a checkpoint
with ``q_lora_rank`` null (Moonlight) has one ``q_proj`` instead. Listing it here makes the
name known to the loader (kept as is); which of the two a layer must have is the config's
(``resin.runners.torch.model_dir.CONFIG_SUBMODULES``).

The next-n (MTP) layers a DeepSeek-V3 checkpoint ships (``num_nextn_predict_layers`` of them,
``model.layers.{num_hidden_layers + i}.*``; HF's class builds none) load as the layers past the
stack (``MTP_PREFIXES``: already named as such, no renaming): their decoder tensors take the
stack's names, their own (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``) reach
``blocks.mtp_input`` / ``blocks.mtp_output`` as the layer's ``mtp`` module. The layer's
``embed_tokens`` and ``shared_head.head`` are copies of the target's ``embed_tokens`` /
``lm_head`` (DeepSeek: "shared with the main model"): the drafter uses the target's, so the
copies are left unused, not read (``IGNORED_PREFIXES``; vocab x hidden each).
"""

WEIGHT_MAP: dict[str, str] = {
    "model.layers.{layer}.self_attn.q_proj.weight": "layers.{layer}.self_attn.q_proj.weight",
}

MTP_PREFIXES = ("model.layers.{layer}.",)
for _name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
    WEIGHT_MAP[f"model.layers.{{layer}}.{_name}"] = f"layers.{{layer}}.mtp.{_name}"

# The next-n layers' copies of the target's embedding and head, at any layer index (the MTP
# layer's is the checkpoint's num_hidden_layers: 61 for DeepSeek-V3 / R1 / V3.1 and Kimi K2, 27
# for Moonlight, 4 for tiny/; no decoder layer of the stack has either tensor).
IGNORED_PREFIXES = tuple(
    f"model.layers.{{layer}}.{copy}." for copy in ("embed_tokens", "shared_head.head")
)
