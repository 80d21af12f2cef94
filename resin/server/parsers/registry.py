"""Parser names (as vLLM spells them) and the defaults for a Hugging Face ``model_type``."""

from __future__ import annotations

from .deepseek import DeepSeekToolParser
from .dsml import DsmlToolParser
from .glm45 import Glm45ToolParser
from .harmony import HarmonyReasoningParser, HarmonyToolParser
from .hermes import HermesToolParser
from .kimi_k2 import KimiK2ToolParser
from .llama3_json import Llama3JsonToolParser
from .minimax_m2 import MiniMaxM2ToolParser
from .qwen3_coder import Qwen3CoderToolParser
from .reasoning import DeepSeekR1ReasoningParser, ThinkReasoningParser

TOOL_PARSERS: dict[str, type] = {
    "hermes": HermesToolParser,
    "qwen25": HermesToolParser,
    "qwen3": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,
    "deepseek_v3": DeepSeekToolParser,  # reads the V3.1 body shape too
    "deepseek_v31": DeepSeekToolParser,  # reads the V3 body shape too
    "deepseek_dsml": DsmlToolParser,  # V3.2 / V4 / V4.1 DSML; reads the V3 / V3.1 shapes too
    "deepseek_v32": DsmlToolParser,
    "deepseek_v4": DsmlToolParser,
    "glm45": Glm45ToolParser,
    "glm47": Glm45ToolParser,  # GLM-4.7: the same tags, no newlines between them
    "llama3_json": Llama3JsonToolParser,
    "openai": HarmonyToolParser,  # gpt-oss harmony: to=functions.NAME messages
    "kimi_k2": KimiK2ToolParser,  # Kimi K2 / K2.5: functions.NAME:i sections
    "minimax_m2": MiniMaxM2ToolParser,  # MiniMax-M2 / M2.1 / M2.5: <minimax:tool_call> invokes
}

REASONING_PARSERS: dict[str, type] = {
    "qwen3": ThinkReasoningParser,
    "glm45": ThinkReasoningParser,
    "deepseek_v3": ThinkReasoningParser,  # reasoning only after <think> (in the output or prompt)
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "deepseek_v4": ThinkReasoningParser,  # as deepseek_v3: the template pre-fills <think> or </think>
    "openai_gptoss": HarmonyReasoningParser,  # gpt-oss harmony: the analysis channel
}

# model_type -> (tool parser, reasoning parser). Qwen3-Coder shares "qwen3_moe" with the
# thinking Qwen3 MoE models, so it is told apart by the model id (see default_parsers).
# "deepseek_v3" is the model_type of DeepSeek-V3 (no thinking), R1 and V3.1 (hybrid) alike, so
# its reasoning parser is "deepseek_v3": reasoning only after a <think> the model writes or the
# template pre-fills (R1-0528 / V3.1 thinking templates do; ChatPrompt.reasoning_started), never
# a plain V3 answer. "deepseek_r1" (all text before </think> is reasoning) stays selectable.
# DeepSeek-V3.2 and V4 write DSML tool calls ("deepseek_dsml"; V3.2-Exp, also "deepseek_v32",
# writes the V3.1 shape, which that parser reads too); their templates end the prompt with
# <think> (thinking) or </think> (not), so the same reasoning rule holds.
_DEFAULTS: dict[str, tuple[str | None, str | None]] = {
    "qwen2": ("hermes", None),  # Qwen2.5 does not think
    "qwen2_moe": ("hermes", None),
    "qwen3": ("hermes", "qwen3"),
    "qwen3_moe": ("hermes", "qwen3"),
    "qwen3_next": ("hermes", "qwen3"),
    "qwen2_vl": ("hermes", None),
    "qwen2_5_vl": ("hermes", None),
    "qwen3_vl": ("hermes", "qwen3"),
    "qwen3_vl_moe": ("hermes", "qwen3"),
    "qwen3_5": ("qwen3_coder", "qwen3"),
    "qwen3_5_moe": ("qwen3_coder", "qwen3"),
    # Qwen3.5's text configs (a checkpoint saved by Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM
    # carries these): the same formats as the wrappers.
    "qwen3_5_text": ("qwen3_coder", "qwen3"),
    "qwen3_5_moe_text": ("qwen3_coder", "qwen3"),
    "qwen3_coder": ("qwen3_coder", None),
    "deepseek_v3": ("deepseek_v3", "deepseek_v3"),
    "deepseek_v32": ("deepseek_v32", "deepseek_v3"),
    "deepseek_v4": ("deepseek_v4", "deepseek_v4"),
    "glm4_moe": ("glm45", "glm45"),
    "glm4v_moe": ("glm45", "glm45"),
    # GLM-5.3-Flash (resin/models/glm5_flash): GLM-4.7's <tool_call> / <arg_key> / <arg_value>
    # spelling, <think> reasoning; the wrapper and the flat text config.
    "glm5_next": ("glm47", "glm45"),
    "glm5_next_text": ("glm47", "glm45"),
    "llama": ("llama3_json", None),
    # gpt-oss writes harmony messages (resin/server/parsers/harmony.py), whose markers are
    # special tokens: these parsers have the server keep them in the text.
    "gpt_oss": ("openai", "openai_gptoss"),
    # Kimi K2 / K2.5 (config model_type; DeepSeek-V3 architecture): its call markers are special
    # tokens too; Thinking variants write <think> blocks, read only where they appear.
    "kimi_k2": ("kimi_k2", "qwen3"),
    "kimi_k25": ("kimi_k2", "qwen3"),
    # MiniMax-M2 / M2.1 / M2.5: <minimax:tool_call> blocks of invokes (plain added tokens); the
    # template ends the prompt with <think>, so the output is reasoning until </think>.
    "minimax_m2": ("minimax_m2", "qwen3"),
}


def default_parsers(
    model_type: str, *, model_id: str | None = None
) -> tuple[str | None, str | None]:
    """``(tool_parser, reasoning_parser)`` for a config's ``model_type``; ``(None, None)`` when
    Resin knows no format for it (mistral, mixtral, gemma, ...).

    ``model_id`` (a path or hub id) is optional: a Qwen3 id containing "coder" selects
    ``qwen3_coder`` without reasoning, since Qwen3-Coder's config says ``qwen3_moe``.
    """
    tool, reasoning = _DEFAULTS.get(model_type, (None, None))
    if model_id and "coder" in model_id.lower() and model_type.startswith("qwen3"):
        return "qwen3_coder", None
    return tool, reasoning
