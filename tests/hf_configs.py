"""Copies of real checkpoints' ``config.json`` (as published on the Hugging Face Hub), for tests.

Qwen2.5-7B-Instruct carries the YaRN ``rope_scaling`` block its model card tells users to add
for contexts past 32,768 tokens. Treat these as read-only: transformers' config classes fill
defaults into nested dicts in place, so pass them a ``copy.deepcopy``.
"""

from __future__ import annotations

from typing import Any

LLAMA31_8B: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
              "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
              "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
              "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
              "pretraining_tp": 1, "rms_norm_eps": 1e-05,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
              "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
              "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
              "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
              "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
              "vocab_size": 32000}
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
             "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584,
             "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 32768,
             "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
             "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
             "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
             "vocab_size": 152064,
             "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
            "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
            "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
            "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
            "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
                 "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
                 "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
                 "initializer_range": 0.02, "intermediate_size": 6144,
                 "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
                 "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
                 "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
                 "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
                 "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
                 "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
                 "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
                 "vocab_size": 151936}
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
                "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
                "initializer_range": 0.02, "intermediate_size": 14336,
                "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
                "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
                "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05,
                "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
                "vocab_size": 32000}
REAL = {"llama": LLAMA31_8B, "mistral": MISTRAL_7B, "qwen2": QWEN25_7B, "qwen3": QWEN3_8B,
        "qwen3_moe": QWEN3_30B_A3B, "mixtral": MIXTRAL_8X7B}
HF_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
              "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig"}
