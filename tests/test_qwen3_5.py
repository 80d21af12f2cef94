"""resin/models/qwen3_5 (Qwen3.5: Qwen3-Next's gated delta net + gated attention hybrid with a
dense MLP, shipped as the multimodal wrapper Qwen3_5ForConditionalGeneration; the text model is
served) passes the parity harness on its committed tiny checkpoint and on variants of it, the
harness would catch the bugs a port is prone to, and ``resin serve`` runs it.

- The tiny checkpoint is a wrapper checkpoint as the hub ships them (``qwen3_5`` config with
  ``text_config`` + a one-block vision tower, ``model.language_model.*`` / ``model.visual.*``
  tensors), with the real ``layer_types`` pattern, 2 value heads per key head, partial rotary
  and randomised ``(1 + w)`` norms / ``dt_bias`` / ``A_log``.
- The reference is HF's wrapper class; for text its interleaved M-RoPE is plain partial rope
  (every position row equal), so its logits equal ``Qwen3_5ForCausalLM``'s and Resin's table
  equals HF's rotary module's.
- fp32 every stage (the prefix-cache stage restarts from recurrent checkpoints); bf16 and fp16
  layers (bf16 bit-exact; fp16 within the measured chunked-vs-recurrent tolerance, parity.toml).
- Planted bugs: Qwen3-Next's per-key-head ``in_proj`` grouping fails at layer 0
  ``linear_attn``; a conv state not carried across steps fails only the engine stages.
- Variants: key head dim != value head dim with 3 value heads per key head (a fresh HF
  checkpoint); the text model saved flat by ``Qwen3_5ForCausalLM`` (``qwen3_5_text``,
  ``model.layers.*``); a hub-style checkpoint with ``mtp.*`` tensors (left unused).
- Serving: the defaults for ``qwen3_5`` / ``qwen3_5_text`` (``qwen3_coder`` tools, ``qwen3``
  reasoning) parse a scripted Qwen3-Coder tool call after reasoning, OpenAI and Anthropic;
  a chat request renders through the tiny's ChatML template and answers as ``LLM.chat``.

torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from resin.evals.model_ref import import_model_module, resolve_model, run_model_parity  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "qwen3_5"
TINY = MODEL_DIR / "tiny"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def blocks() -> Any:
    return import_model_module(MODEL_DIR, "blocks", "qwen3_5")


def parity(
    checkpoint: Path | None = None,
    dtype: str = "float32",
    layers_only: bool = False,
    model_dir: Path = MODEL_DIR,
) -> Any:
    """``resin eval parity`` of ``model_dir`` (on ``checkpoint``, default its tiny/)."""
    checks = ("layers",) if layers_only else None
    return run_model_parity(
        resolve_model(model_dir), dtype=dtype, checkpoint=checkpoint, checks=checks
    )


def test_tiny_is_a_wrapper_checkpoint_that_cannot_hide_qwen3_5_bugs() -> None:
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 2_000_000
    config = json.loads((TINY / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["model_type"] == "qwen3_5" and "vision_config" in config
    text = config["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["linear_num_value_heads"] > text["linear_num_key_heads"]
    assert text["rope_parameters"]["partial_rotary_factor"] < 1
    assert config["tie_word_embeddings"]  # as Qwen3.5-0.8B's (the untied layout: a variant)
    from safetensors.torch import load_file

    tensors = load_file(str(TINY / "model.safetensors"))
    assert any(n.startswith("model.visual.") for n in tensors)
    assert all(n.startswith(("model.language_model.", "model.visual.")) for n in tensors)
    norms = [t for n, t in tensors.items() if n.endswith(("layernorm.weight", "_norm.weight"))]
    assert norms and all(float(t.abs().max()) > 0.1 for t in norms)  # (1 + w): not zeros
    for name, t in tensors.items():
        if name.endswith("linear_attn.A_log"):
            assert float(t.exp().max()) < 3.0  # A, not HF's up-to-16: the state carries over
        if name.endswith("linear_attn.dt_bias"):
            assert not torch.equal(t, torch.ones_like(t))


def test_reference_is_the_wrapper_and_text_positions_make_mrope_plain(blocks: Any) -> None:
    """The harness's reference is ``Qwen3_5ForConditionalGeneration`` (the hub class), whose
    text-only logits equal ``Qwen3_5ForCausalLM``'s on the same tensors; HF's interleaved M-RoPE
    module at text positions (all rows equal) gives Resin's partial-rope table."""
    from resin.scaffold import hf_model

    config = transformers.AutoConfig.from_pretrained(TINY)
    assert hf_model.lm_auto_class(config) is transformers.AutoModelForImageTextToText
    wrapper = hf_model.from_pretrained(TINY, dtype=torch.float32).eval()
    assert type(wrapper).__name__ == "Qwen3_5ForConditionalGeneration"
    causal = transformers.Qwen3_5ForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    ids = torch.randint(4, 384, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(wrapper(ids).logits, causal(ids).logits)

    text = config.text_config
    rotary = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(text)
    positions = torch.arange(70)
    hf_cos, hf_sin = rotary(torch.zeros(1, 70, 1), positions.view(1, 1, -1).expand(3, 1, -1))
    table = blocks.ROTARY["Qwen3_5TextRotaryEmbedding"](text, text.head_dim, torch.device("cpu"))
    cos, sin = table.cos_sin(positions, torch.float32)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


def test_parity_fp32_every_stage() -> None:
    report = parity()
    assert report.passed, report.summary()
    layers = report.stage("layers")
    assert not layers.metrics["missing"] and layers.metrics["num_checkpoints"] == 22
    assert layers.metrics["max_scaled_diff"] < 1e-5
    assert report.stage("greedy/prefix_cache").metrics["num_cached_tokens"] > 0
    assert report.stage("greedy/preemption").metrics["num_preemptions"] > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_parity_half_layers(dtype: str) -> None:
    report = parity(dtype=dtype, layers_only=True)
    assert report.passed, report.summary()
    if dtype == "bfloat16":
        assert report.stage("layers").metrics["max_scaled_diff"] == 0.0


def test_qwen3_next_in_proj_grouping_fails_at_layer0_linear_attn(
    blocks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading ``in_proj_qkv`` grouped per key head (Qwen3-Next's ``in_proj_qkvz`` layout)
    instead of flat ``[q | k | v]``."""
    import torch.nn.functional as F

    from resin.models.qwen3_next import blocks as next_blocks
    from resin.runners.torch.layer_caches import gated_delta_net_dims

    def grouped(x: Any, w: Any, ctx: Any) -> Any:
        d = gated_delta_net_dims(ctx.config)
        nk, nv, dk, dv, n = d["nk"], d["nv"], d["dk"], d["dv"], x.shape[0]
        qkv = F.linear(x, w["in_proj_qkv.weight"]).view(n, nk, 2 * dk + nv // nk * dv)
        q, k, v = torch.split(qkv, [dk, dk, nv // nk * dv], dim=-1)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        z = F.linear(x, w["in_proj_z.weight"]).view(n, nv, dv)
        b, a = F.linear(x, w["in_proj_b.weight"]), F.linear(x, w["in_proj_a.weight"])
        return next_blocks.gated_delta_net_mix(mixed, z, b, a, w, ctx)

    monkeypatch.setitem(blocks.BLOCKS, "Qwen3_5GatedDeltaNet", grouped)
    report = parity(layers_only=True)
    first = report.first_departure
    assert first is not None and (first["layer"], first["module"]) == (0, "linear_attn")


def test_conv_state_not_carried_fails_only_the_engine_stages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from resin.models.qwen3_next import blocks as next_blocks

    right = next_blocks.causal_conv
    monkeypatch.setattr(
        next_blocks, "causal_conv", lambda x, state, *rest: right(x, torch.zeros_like(state), *rest)
    )
    report = parity()
    assert report.stage("layers").passed and report.stage("logits").passed
    for stage in ("greedy/page_size=16", "greedy/prefix_cache", "greedy/chunked_prefill"):
        assert not report.stage(stage).passed, stage


def fresh_wrapper_checkpoint(
    path: Path, tiny: Path = TINY, tied: bool | None = None, **text_changes: Any
) -> Path:
    """A new random-weight wrapper checkpoint like ``tiny``'s with ``text_changes`` (and
    ``tie_word_embeddings`` = ``tied`` unless None): O(1) activations, the (1 + w) norms,
    dt_bias and A_log drawn as the tiny's are; saved with its tokenizer."""
    config = transformers.AutoConfig.from_pretrained(tiny)
    for key, value in text_changes.items():
        setattr(config.text_config, key, value)
    if tied is not None:
        config.tie_word_embeddings = config.text_config.tie_word_embeddings = tied
    config.text_config.initializer_range = 0.15  # as tiny/'s spread (HF: 0.02)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "visual" not in name:
                p.normal_(1.0 if "linear_attn.norm" in name else 0.0, 0.3)
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.1, 0.9).log())
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / f, path / f)
    return path


def test_parity_with_key_dim_unlike_value_dim_and_three_value_heads_per_key(
    tmp_path: Path,
) -> None:
    """Also checks architecture.json's shape rules accept other GDN widths (a source config
    whose conv width happened to be 2 x hidden_size recorded that as a rule)."""
    path = fresh_wrapper_checkpoint(
        tmp_path / "q35", linear_key_head_dim=8, linear_value_head_dim=12, linear_num_value_heads=6
    )
    report = parity(path, layers_only=True)
    assert report.passed, report.summary()


def test_parity_untied_lm_head(tmp_path: Path) -> None:
    """The larger Qwen3.5 models (27B) keep a separate lm_head."""
    path = fresh_wrapper_checkpoint(tmp_path / "q35", tied=False)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()
    report = parity(path, layers_only=True)
    assert report.passed, report.summary()


@pytest.mark.parametrize("names", ["as_saved", "flat"])
def test_parity_on_the_text_model_saved_by_qwen3_5_for_causal_lm(
    tmp_path: Path, names: str
) -> None:
    """A text-only checkpoint: ``Qwen3_5ForCausalLM``'s config (``qwen3_5_text``, no
    ``text_config``), its tensors as transformers saves them (``model.language_model.*``, the
    conversion mapping reversed) or flat (``model.layers.*``, which HF loads too)."""
    from safetensors.torch import load_file, save_file

    causal = transformers.Qwen3_5ForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    path = tmp_path / "text"
    causal.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TINY / f, path / f)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and "text_config" not in config
    tensors = load_file(str(path / "model.safetensors"))
    assert all(n.startswith("model.language_model.") for n in tensors)
    if names == "flat":
        tensors = {n.replace("model.language_model.", "model."): t for n, t in tensors.items()}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    report = parity(path, layers_only=True)
    assert report.passed, report.summary()
    # The registry finds the wrapper's directory for it by its model_type (transformers builds
    # the text model from it), with no --runner.
    from resin.registry import ModelRegistry

    assert ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(path).name == "qwen3_5"


def test_a_checkpoint_with_the_mtp_head_loads_it_unused(tmp_path: Path) -> None:
    check_mtp_head_left_unused(TINY, tmp_path)


def check_mtp_head_left_unused(tiny: Path, tmp_path: Path) -> None:
    """Hub checkpoints carry Qwen3-Next-style ``mtp.*`` tensors that HF drops; the runner leaves
    them unused (``weights.IGNORED_PREFIXES``) and answers as without them."""
    from safetensors.torch import load_file, save_file

    from resin import SamplingParams
    from resin.llm import LLM

    path = tmp_path / "with_mtp"
    shutil.copytree(tiny, path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    tensors["mtp.norm.weight"] = torch.zeros(64)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    prompts = [[5, 17, 42, 99, 7], [11, 12, 13]]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    want = [o.token_ids for o in LLM(tiny, max_model_len=64).generate(prompts, params)]
    with pytest.warns(UserWarning, match="does not use"):
        llm = LLM(path, max_model_len=64)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want


def test_default_parsers_cover_the_wrapper_and_text_model_types() -> None:
    from resin.server.parsers.registry import default_parsers

    for model_type in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"):
        assert default_parsers(model_type) == ("qwen3_coder", "qwen3"), model_type


QWEN_CALL = (
    "<think>\nOslo, two days.\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n"
    "</tool_call>"
)


def test_served_tool_call_with_the_checkpoint_defaults() -> None:
    """``resin serve`` defaults for model_type qwen3_5 parse a Qwen3-Coder call after reasoning
    (a scripted runner emits it through the tiny's tokenizer), OpenAI and Anthropic."""
    pytest.importorskip("anthropic")
    pytest.importorskip("openai")
    from tests.scripted_tool_calls import check_anthropic, check_openai, scripted_server

    with scripted_server(TINY, QWEN_CALL, "qwen3.5-tiny") as live:
        check_openai(live, "qwen3.5-tiny", ("tool_call", "function=", "parameter="))
        check_anthropic(live, "qwen3.5-tiny")


def test_served_chat_renders_the_template_and_answers_as_llm_chat() -> None:
    check_served_chat(MODEL_DIR)


def check_served_chat(model_dir: Path) -> None:
    """The real runner behind ``resin serve`` (the registry's pick for the tiny): a chat
    request goes through the tiny's ChatML template and returns ``LLM.chat``'s greedy tokens
    (which parity ties to HF)."""
    openai = pytest.importorskip("openai")
    from resin import SamplingParams
    from resin.llm import LLM
    from resin.registry import ModelRegistry
    from resin.server.context import ServerOptions
    from resin.server.serve import build_context
    from tests.server_harness import LiveServer

    tiny = model_dir / "tiny"
    assert ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(tiny).name == model_dir.name
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    llm = LLM(tiny, max_model_len=128)
    (want,) = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0.0))
    ctx = build_context(
        tiny, options=ServerOptions(served_model_names=["qwen3.5-tiny"]), max_model_len=128
    )
    with LiveServer(ctx) as live:
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0)
        response = client.chat.completions.create(
            model="qwen3.5-tiny",
            messages=messages,
            max_tokens=8,
            temperature=0,  # type: ignore[arg-type]
        )
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(want.prompt_token_ids)
    assert response.usage.completion_tokens == len(want.token_ids)
    assert response.choices[0].message.content == want.text
