"""HF's GLM-5.3-Flash text path as a causal LM, without the vision tower (``make_tiny.py``).

transformers 5.24 has no ``AutoModelForCausalLM`` entry for ``glm5_next`` (only
``Glm5NextForConditionalGeneration``, whose text model sits at ``model.language_model``). The
parity harness now loads that class itself (``resin.scaffold.hf_model``, NOTES.md gap 1); this
module remains what ``make_tiny.py`` builds and saves — a text-only checkpoint with the
causal-LM names (``model.layers.*``) and no vision tower — and what the reference test compares
the wrapper class with. ``Glm5FlashTextForCausalLM``: HF's own ``Glm5NextTextModel`` plus
``lm_head``, the same math as the wrapper's text-only forward
(``lm_head(norm(hc_head(streams)))``), for ``Glm5NextConfig`` (multimodal wrapper or flat: the
config class folds a flat one into ``text_config``) and ``Glm5NextTextConfig``.
``import_reference()`` registers both with ``AutoModelForCausalLM`` (as the scaffold run of
loop row 2 needed; ``make_tiny.py`` calls it). Importing the module does not: a test that
loads it must leave transformers' registry as it found it (the wrapper-config fallback
tests assert there is no causal-LM class).
"""

from __future__ import annotations

import transformers
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.glm5_next import modeling_glm5_next as M
from transformers.models.glm5_next.configuration_glm5_next import (
    Glm5NextConfig,
    Glm5NextTextConfig,
)


class Glm5FlashTextForCausalLM(M.Glm5NextPreTrainedModel, transformers.GenerationMixin):
    """``Glm5NextTextModel`` (``model``) + ``lm_head``: GLM-5.3-Flash without the vision tower."""

    config_class = Glm5NextConfig
    base_model_prefix = "model"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _keys_to_ignore_on_load_unexpected = [
        r"visual\.",
        *M.Glm5NextPreTrainedModel._keys_to_ignore_on_load_unexpected,
    ]

    def __init__(self, config):
        super().__init__(config)
        text = config.get_text_config()
        text._attn_implementation = config._attn_implementation or "eager"
        # the outer config's experts implementation (eager: HF's per-expert loop), not the
        # sub-config's own default (grouped_mm: the same math, other bf16 rounding)
        text._experts_implementation = getattr(config, "_experts_implementation", None) or "eager"
        if not hasattr(config, "vocab_size"):
            # a wrapper config keeps it in text_config only; the parity harness reads
            # model.config.vocab_size (NOTES.md, toolkit gap 1)
            config.vocab_size = text.vocab_size
        self.model = M.Glm5NextTextModel(text)
        self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = M.slice_logits_to_keep(out.last_hidden_state, logits_to_keep)
        return CausalLMOutputWithPast(logits=self.lm_head(hidden), past_key_values=out.cache)


class Glm5FlashTextOnlyForCausalLM(Glm5FlashTextForCausalLM):
    config_class = Glm5NextTextConfig


def import_reference() -> None:
    """Register both classes with ``AutoModelForCausalLM`` (idempotent)."""
    auto = transformers.AutoModelForCausalLM
    auto.register(Glm5NextConfig, Glm5FlashTextForCausalLM, exist_ok=True)
    auto.register(Glm5NextTextConfig, Glm5FlashTextOnlyForCausalLM, exist_ok=True)
