"""GLM-4.5 / 4.6's MTP layer (``model.layers.{num_hidden_layers}.*``, resin/models/glm4_moe)
drafting for speculative decoding.

The committed tiny checkpoint ships the layer as GLM-4.5 does (``source/make_tiny.py``: a MoE
decoder layer with per-expert tensors and seeded values, ``eh_proj``, ``enorm``, ``hnorm``,
``shared_head.norm``, and copies of the target's embedding and head as ``embed_tokens`` /
``shared_head.head``); transformers ignores the layer, so the target is the 4-layer tiny model.
transformers builds no MTP layer, so the drafts are checked against one assembled from its
modules (vLLM's ``glm4_moe_mtp.py`` math): a one-layer HF ``Glm4MoeForCausalLM`` whose layer
(a MoE: ``first_k_dense_replace`` 0) holds the MTP layer's decoder tensors, its final norm
removed (the layer's raw output is the next draft step's hidden state), fed
``eh_proj(cat([enorm(embed(t[s])), hnorm(h[s-1])]))`` through HF's ``Glm4MoeRMSNorm`` and a
``Linear`` — ``h`` the target's final, normed hidden state from HF's full forward, the embedding
zeroed at position 1 (vLLM's "masking inputs at position 0": its position 0 is Resin's 1) — and
read out by ``shared_head.norm`` (an HF ``Glm4MoeRMSNorm``) and the target's ``lm_head``. The
reference's MTP sequence is vLLM's: entries ``s = 1, 2, ...`` only (vLLM's ``(h[p], t[p+1])`` at
``p = s - 1``; ``position_ids`` from 1, the same attention, RoPE being relative), no entry at
position 0, which the runner writes from a zero input (K / V its biases) but lets no draft
attend (``mtp_drafter``). A draft chain extends that sequence with the layer's raw output and
its argmax. Every draft the runner proposes (k = 1 and 3, prompts in one
chunk or several, a prefix-cache hit) must be that reference's. With MTP on, greedy output is
the output with speculation off (k = 1..3, chunked prefill, prefix hits, preemption), also on a
"self-drafting" variant whose MTP layer copies a one-layer target's layer (most drafts accepted:
the engine's partial-acceptance paths), and ``resin serve`` drafts.

The tiny's random MTP layer drafts tokens the target never accepts; the self-drafting variant
(a one-layer target, the MTP layer its layer with ``eh_proj`` passing the embedding through,
embedding rows of unit RMS so ``enorm`` changes nothing) accepts about 3 drafts in 4.

torch runs one thread here (shared 2-core machines).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import resin  # noqa: E402
from resin.llm import LLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "glm4_moe"
TINY = MODEL_DIR / "tiny"
RUNNER = str(MODEL_DIR)
MTP = "model.layers.4."  # the tiny's next-n layer (num_hidden_layers 4)
COPIES = [MTP + "embed_tokens.weight", MTP + "shared_head.head.weight"]
PROMPTS = [list(range(5, 50)), [9, 8, 7] * 7 + list(range(100, 122)), [3] * 13]
SMALL: dict[str, Any] = {"runner": RUNNER, "max_num_seqs": 2, "max_model_len": 96}
pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:.*checkpoint tensor"),
]


def _variant(
    path: Path,
    edit: Callable[[dict[str, Any]], dict[str, Any]],
    config: dict[str, Any] | None = None,
) -> Path:
    """The tiny checkpoint with its tensors through ``edit`` and config.json updated by
    ``config``, in ``path``."""
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    for f in TINY.iterdir():
        shutil.copy(f, path / f.name)
    tensors = edit(load_file(str(TINY / "model.safetensors")))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if config:
        values = json.loads((TINY / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**values, **config}))
    return path


@pytest.fixture(scope="module")
def no_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny without its next-n layer."""

    def edit(t: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in t.items() if not k.startswith(MTP)}

    return _variant(tmp_path_factory.mktemp("no_mtp"), edit)


@pytest.fixture(scope="module")
def self_drafting(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer target (the tiny's MoE layer 1 as layer 0; embedding rows of unit RMS) whose
    MTP layer (layer 1) is that layer fed ``eh_proj = [I | 0]`` (the embedding alone) and read
    out by the target's final norm: it drafts what the target would say, up to the first token,
    which its attention never sees (vLLM's MTP sequence starts at position 1, whose embedding
    it zeroes)."""

    def edit(t: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in t.items() if not k.startswith("model.layers.")}
        embed = out["model.embed_tokens.weight"]
        out["model.embed_tokens.weight"] = embed / embed.pow(2).mean(-1, keepdim=True).sqrt()
        for name, tensor in t.items():
            if name.startswith("model.layers.1."):
                rest = name[len("model.layers.1.") :]
                out["model.layers.0." + rest] = tensor
                out["model.layers.1." + rest] = tensor.clone()
        hidden = embed.shape[1]
        out["model.layers.1.eh_proj.weight"] = torch.cat(
            [torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1
        )
        out["model.layers.1.enorm.weight"] = torch.ones(hidden)
        out["model.layers.1.hnorm.weight"] = torch.ones(hidden)
        out["model.layers.1.shared_head.norm.weight"] = out["model.norm.weight"].clone()
        return out

    config = {"num_hidden_layers": 1, "first_k_dense_replace": 0}
    return _variant(tmp_path_factory.mktemp("self_drafting"), edit, config)


def _hf(path: Path) -> Any:
    import transformers

    return transformers.Glm4MoeForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def test_the_mtp_layer_loads_past_the_stack(no_mtp: Path) -> None:
    params = resin.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    plain = LLM(no_mtp, **SMALL)
    assert plain.runner.model.mtp is None and plain.runner.weights.unused == []
    llm = LLM(TINY, **SMALL)
    expected = [o.token_ids for o in plain.generate(PROMPTS[:2], params)]
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], params)] == expected
    runner = llm.runner
    mtp = runner.model.mtp
    assert mtp is not None and len(runner.weights.layers) == 5 and mtp.layers[0].index == 4
    assert mtp.layers[0].layer_type == "full_attention" and mtp.hidden_shape == (64,)
    layer = runner.weights.layers[4]
    assert "mlp.gate.e_score_correction_bias" in layer and "mlp.experts.7.up_proj.weight" in layer
    assert "self_attn.q_norm.weight" in layer and "mlp.shared_experts.up_proj.weight" in layer
    assert set(runner.weights.module(4, "mtp")) == {
        "eh_proj.weight",
        "enorm.weight",
        "hnorm.weight",
        "shared_head.norm.weight",
    }
    # GLM-4.5's copies of the shared embedding and head: the target's are used, these not read
    assert runner.weights.unused == COPIES
    assert not any("embed_tokens" in k or "shared_head.head" in k for k in layer)
    assert len(runner.cache_spec()) == len(plain.runner.cache_spec())  # MTP caches: only with k
    # transformers ignores the layer: its target is the tiny model without it
    a, b = _hf(TINY).state_dict(), _hf(no_mtp).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_tiny_s_copies_are_the_target_s() -> None:
    """As in GLM-4.5's checkpoint (vLLM PR 27597: "shared with" the target's)."""
    from safetensors.torch import load_file

    t = load_file(str(TINY / "model.safetensors"))
    assert torch.equal(t[COPIES[0]], t["model.embed_tokens.weight"])
    assert torch.equal(t[COPIES[1]], t["lm_head.weight"])
    assert not any(".experts.gate_up_proj" in k for k in t)  # per-expert, as GLM-4.5 ships


def test_a_missing_mtp_tensor_is_named(no_mtp: Path, tmp_path: Path) -> None:
    from resin.loading.weights import WeightsError

    def edit(t: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in t.items() if k != MTP + "hnorm.weight"}

    broken = _variant(tmp_path / "broken", edit)
    with pytest.raises(
        WeightsError, match=r"MTP layer 0 is missing tensor\(s\) model\.layers\.4\.hnorm"
    ):
        LLM(broken, **SMALL)
    with pytest.raises(ValueError, match="no MTP layer"):
        LLM(no_mtp, speculative_method="mtp", **SMALL)


# -- the drafts against a reference built from transformers' modules ----------------------


class Reference:
    """The MTP layer's greedy draft chain for a token sequence, computed with HF modules (see
    the module doc)."""

    def __init__(self, checkpoint: Path, tmp: Path):
        import transformers
        from safetensors.torch import load_file, save_file

        Glm4MoeRMSNorm = transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeRMSNorm
        self.target = _hf(checkpoint)
        tensors = load_file(str(checkpoint / "model.safetensors"))
        config = json.loads((checkpoint / "config.json").read_text())
        prefix = f"model.layers.{config['num_hidden_layers']}."
        w = {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
        own = ("eh_proj.", "enorm.", "hnorm.", "shared_head.", "embed_tokens.")
        layer = {"model.layers.0." + k: t for k, t in w.items() if not k.startswith(own)}
        layer |= {k: t for k, t in tensors.items() if not k.startswith("model.layers.")}
        tmp.mkdir(parents=True, exist_ok=True)
        save_file(layer, str(tmp / "model.safetensors"))
        config.update(num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0)
        (tmp / "config.json").write_text(json.dumps(config))
        self.mtp = _hf(tmp)
        assert type(self.mtp.model.layers[0].mlp).__name__ == "Glm4MoeMoE"
        self.mtp.model.norm = torch.nn.Identity()  # the decoder layer's raw output
        hidden, eps = int(config["hidden_size"]), float(config["rms_norm_eps"])
        self.norms = {}
        for name in ("enorm", "hnorm", "shared_head.norm"):
            norm = Glm4MoeRMSNorm(hidden, eps=eps)
            norm.weight.data.copy_(w[name + ".weight"])
            self.norms[name] = norm
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.eh_proj.weight.data.copy_(w["eh_proj.weight"])

    def _inputs(self, prev: Any, tokens: Any) -> Any:
        e = self.norms["enorm"](self.target.model.embed_tokens(tokens))
        return self.eh_proj(torch.cat([e, self.norms["hnorm"](prev)], dim=-1))

    @torch.no_grad()
    def drafts(self, ids: list[int], k: int) -> list[int]:
        """Greedy drafts after ``ids`` (its last token the one the engine just committed)."""
        h = self.target.model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # normed
        # vLLM's MTP sequence: the entries at positions 1.. (h[s-1], t[s]), none at 0
        e = self.target.model.embed_tokens(torch.tensor(ids[1:]))
        e[0] = 0  # vLLM's "masking inputs at position 0": its position 0 is Resin's 1
        x = self.eh_proj(torch.cat([self.norms["enorm"](e), self.norms["hnorm"](h[:-1])], -1))
        out: list[int] = []
        for _ in range(k):
            positions = torch.arange(1, x.shape[0] + 1)[None]
            y = self.mtp.model(inputs_embeds=x[None], position_ids=positions).last_hidden_state[0]
            logits = self.target.lm_head(self.norms["shared_head.norm"](y[-1]))
            out.append(int(logits.argmax(-1)))
            x = torch.cat([x, self._inputs(y[-1:], torch.tensor(out[-1:]))])
        return out


def _record_drafts(llm: LLM) -> list[tuple[int, int, list[int]]]:
    """(bonus position, bonus token, drafts) of every drafting row, as the drafter proposes."""
    drafter = llm.runner.drafter
    records: list[tuple[int, int, list[int]]] = []
    chain = drafter._chain

    def recording(step, cached, hidden, bonus, rows, last):  # type: ignore[no-untyped-def]
        drafts = chain(step, cached, hidden, bonus, rows, last)
        positions = step.positions[torch.as_tensor(last)] + 1
        for p, b, d in zip(positions.tolist(), bonus.tolist(), drafts.tolist()):
            records.append((p, b, d))
        return drafts

    drafter._chain = recording
    return records


def _metric(llm: LLM, name: str) -> float:
    match = re.search(rf"^resin:{name}(?:\{{\}})? (\S+)", llm.engine.metrics_text(), re.M)
    assert match, name
    return float(match.group(1))


@pytest.mark.parametrize(
    "k, engine, checkpoint",
    [
        (1, {}, "tiny"),
        (3, {"max_num_batched_tokens": 14}, "tiny"),  # prompts in chunks
        (3, {}, "self_drafting"),  # most drafts accepted: chains from mid-row positions
    ],
)
def test_every_draft_is_the_reference_mtp_layer_s(
    self_drafting: Path, tmp_path: Path, k: int, engine: dict[str, Any], checkpoint: str
) -> None:
    path = TINY if checkpoint == "tiny" else self_drafting
    reference = Reference(path, tmp_path / "reference")
    params = resin.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(path, speculative_method="mtp", num_speculative_tokens=k, **SMALL, **engine)
    records = _record_drafts(llm)
    outs = llm.generate(PROMPTS[:2], params)
    again = llm.generate([PROMPTS[0][:40] + [7, 7]], params)  # a prefix hit (32 tokens)
    assert again[0].num_cached_tokens > 0
    sequences = [o.prompt_token_ids + o.token_ids for o in outs + again]
    if checkpoint == "self_drafting":
        assert _metric(llm, "spec_decode_num_accepted_tokens_total") > 0
    assert len(records) >= 3 * (params.max_tokens // (k + 1))
    for position, bonus, drafts in records:
        owners = [s for s in sequences if len(s) > position and s[position] == bonus]
        assert owners, (position, bonus)
        assert any(reference.drafts(s[: position + 1], k) == drafts for s in owners), (
            position,
            drafts,
        )


def test_greedy_is_identical_with_mtp_speculation(self_drafting: Path) -> None:
    params = resin.SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    base: dict[str, Any] = {"max_num_seqs": 3, "max_model_len": 96, "runner": RUNNER}
    cases: list[tuple[Path, int, dict[str, Any]]] = [
        (TINY, 1, {"num_pages": 600}),
        (TINY, 2, {"max_num_batched_tokens": 9, "num_pages": 600}),  # chunked prefill
        (TINY, 3, {"page_size": 4, "max_num_batched_tokens": 16, "num_pages": 150}),  # preemption
        (self_drafting, 2, {"max_num_batched_tokens": 9, "num_pages": 600}),
        (self_drafting, 3, {"page_size": 4, "max_num_batched_tokens": 16, "num_pages": 56}),
    ]
    off = {
        path: [o.token_ids for o in LLM(path, **base).generate(PROMPTS, params)]
        for path in (TINY, self_drafting)
    }
    for path, k, engine in cases:
        llm = LLM(path, speculative_method="mtp", num_speculative_tokens=k, **base, **engine)
        case = (path.name, k, engine)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == off[path], case
        assert _metric(llm, "spec_decode_num_drafts_total") > 0
        if path == self_drafting:
            accepted = _metric(llm, "spec_decode_num_accepted_tokens_total")
            assert accepted > _metric(llm, "spec_decode_num_draft_tokens_total") / 2, case
        if "page_size" in engine:
            assert _metric(llm, "num_preemptions_total") > 0, case
        else:
            again = llm.generate(PROMPTS, params)  # prefix hits
            assert [o.token_ids for o in again] == off[path], case
            assert sum(o.num_cached_tokens for o in again) > 0, case


def test_bfloat16_greedy_is_identical_with_mtp_speculation() -> None:
    """bf16 weights (the MTP layer's router kept fp32, as the stack's): the same output with
    and without drafting. (Against a run with the same chunking: chunked prefill alone changes
    this tiny's bf16 greedy output, speculation or not.)"""
    params = resin.SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    base: dict[str, Any] = {
        "max_num_seqs": 3,
        "max_model_len": 96,
        "runner": RUNNER,
        "dtype": "bfloat16",
    }
    off = [o.token_ids for o in LLM(TINY, **base).generate(PROMPTS, params)]
    llm = LLM(TINY, speculative_method="mtp", num_speculative_tokens=3, **base)
    layer = llm.runner.weights.layers[4]
    assert layer["mlp.gate.weight"].dtype == torch.float32
    assert layer["mtp.eh_proj.weight"].dtype == torch.bfloat16
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == off
    assert _metric(llm, "spec_decode_num_drafts_total") > 0


def test_glm46_layout_without_the_copies_drafts_the_same(tmp_path: Path) -> None:
    """GLM-4.6 ships no ``embed_tokens`` / ``shared_head.head`` in its MTP layer: it loads, and
    drafts as GLM-4.5's layout (whose copies are left unused)."""

    def edit(t: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in t.items() if k not in COPIES}

    glm46 = _variant(tmp_path / "glm46", edit)
    params = resin.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results = []
    for path in (TINY, glm46):
        llm = LLM(path, speculative_method="mtp", num_speculative_tokens=2, **SMALL)
        records = _record_drafts(llm)
        outs = [o.token_ids for o in llm.generate(PROMPTS[:2], params)]
        results.append((outs, records, llm.runner.weights.unused))
    assert results[0][:2] == results[1][:2] and results[0][1]
    assert results[0][2] == COPIES and results[1][2] == []


def test_resin_serve_drafts_with_mtp() -> None:
    """``resin serve --speculative-method mtp``: the same answer as without speculation, the
    drafts counted on /metrics."""
    import httpx
    import openai

    from resin.server.context import ServerOptions
    from resin.server.serve import build_context
    from tests.server_harness import LiveServer

    expected = LLM(TINY, runner=RUNNER, max_num_seqs=2, max_model_len=256).generate(
        ["Count to ten."], resin.SamplingParams(max_tokens=12, temperature=0.0)
    )[0]
    ctx = build_context(
        TINY,
        runner=RUNNER,
        options=ServerOptions(served_model_names=["glm45"]),
        max_num_seqs=2,
        max_model_len=256,
        speculative_method="mtp",
        num_speculative_tokens=2,
    )
    with LiveServer(ctx) as live:
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0)
        done = client.completions.create(
            model="glm45", prompt="Count to ten.", max_tokens=12, temperature=0
        )
        assert done.choices[0].text == expected.text
        metrics = httpx.get(f"{live.base_url}/metrics").text
        assert re.search(r"^resin:spec_decode_num_drafts_total [1-9]", metrics, re.M)
