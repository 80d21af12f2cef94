"""Checkpoint tensors of gpt_oss (GptOssForCausalLM) beyond the defaults: how they shard.

The checkpoint's names are the runner's (minus ``model.``), so there is no ``WEIGHT_MAP``.
``TENSOR_PARALLEL`` gives each tensor's tensor-parallel split (runner names relative to the
layer, or global; kinds in :mod:`resin.runners.parallel.sharding`): attention by heads — the
per-head ``sinks`` too — with ``o_proj`` row-parallel (its bias added once, by rank 0); every
expert's fused, interleaved ``gate_up_proj`` [E, hidden, 2*width] split along its last
dimension (an even split keeps each gate / up pair together) with ``down_proj`` [E, width,
hidden] by width (its bias added once); the vocabulary for ``embed_tokens`` / ``lm_head``. The
router and the norms are replicated. The blocks read head counts and widths off the weights,
so they run unchanged on a shard.
"""

TENSOR_PARALLEL: dict[str, tuple[str, int | None]] = {
    "self_attn.q_proj.weight": ("heads", 0),
    "self_attn.q_proj.bias": ("heads", 0),
    "self_attn.k_proj.weight": ("kv_heads", 0),
    "self_attn.k_proj.bias": ("kv_heads", 0),
    "self_attn.v_proj.weight": ("kv_heads", 0),
    "self_attn.v_proj.bias": ("kv_heads", 0),
    "self_attn.o_proj.weight": ("heads", 1),
    "self_attn.o_proj.bias": ("once", None),
    "self_attn.sinks": ("head_scalars", 0),
    "mlp.experts.gate_up_proj": ("width", 2),
    "mlp.experts.gate_up_proj_bias": ("width", 1),
    "mlp.experts.down_proj": ("width", 1),
    "mlp.experts.down_proj_bias": ("once", None),
    "embed_tokens.weight": ("vocab", 0),
    "lm_head.weight": ("vocab", 0),
}

# Expert parallelism: the experts' dimension of each fused expert tensor. A rank holds a
# contiguous block of whole experts (its biases included: each expert lives on one rank) and
# the MoE block skips the others (``expert_parallel_first_expert`` in the rank's config).
EXPERT_PARALLEL: dict[str, int] = {
    "mlp.experts.gate_up_proj": 0,
    "mlp.experts.gate_up_proj_bias": 0,
    "mlp.experts.down_proj": 0,
    "mlp.experts.down_proj_bias": 0,
}
NUM_EXPERTS = "num_local_experts"  # the config key counting the experts
