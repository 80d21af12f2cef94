"""Checkpoint tensor names for deepseek_v3 (DeepseekV3ForCausalLM) that the record lacks.

Checkpoint names are HF's (no renames). ``architecture.json`` was made from DeepSeek-V3's
config, whose MLA query is low-rank (``q_a_proj -> q_a_layernorm -> q_b_proj``); a checkpoint
with ``q_lora_rank`` null (Moonlight) has one ``q_proj`` instead. Listing it here makes the
name known to the loader (kept as is); which of the two a layer must have is the config's
(``resin.runners.torch.model_dir.CONFIG_SUBMODULES``).

The next-n (MTP) layers a DeepSeek-V3 checkpoint ships (``model.layers.{num_hidden_layers}.*``)
need no entry: HF's class builds none, and the loader leaves a layer past the stack unused.
"""

WEIGHT_MAP: dict[str, str] = {
    "model.layers.{layer}.self_attn.q_proj.weight": "layers.{layer}.self_attn.q_proj.weight",
}
