"""DeepSeek-V3's MTP layer (``model.layers.{num_hidden_layers}.*``) drafting for speculative
decoding.

The checkpoint is the committed tiny one, which ships the layer as DeepSeek-V3 / R1 do
(``source/make_tiny.py``: ``num_nextn_predict_layers`` 1, a MoE decoder layer with seeded random
tensors, one tensor per expert, ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.norm``, and
``embed_tokens`` / ``shared_head.head`` copies of the target's); transformers ignores that layer.
transformers builds no MTP layer, so the drafts are checked against one assembled from its
modules: a one-layer HF ``DeepseekV3ForCausalLM`` whose layer 0 (a MoE) holds the MTP layer's
decoder tensors and whose final norm is ``shared_head.norm`` (embedding and ``lm_head`` the
target's), fed vLLM's ``DeepSeekMultiTokenPredictorLayer`` input ``eh_proj(cat([enorm(e),
hnorm(h)]))`` (HF ``DeepseekV3RMSNorm`` modules) with ``e`` the target's embedding of token
``t[s]`` (zeroed at position 1: vLLM's "masking inputs at position 0", its position 0 being
Resin's 1) and ``h`` the target's final-normed hidden state at ``s - 1`` from HF's full forward.
The reference's MTP sequence is vLLM's: entries ``s = 1, 2, ...`` only (vLLM's ``(h[p],
t[p+1])`` at ``p = s - 1``; RoPE at Resin's positions, ``position_ids`` from 1: the same
attention, RoPE being relative), no entry at position 0 — which the runner writes from a zero
input but must never let a draft attend (``mtp_drafter``; a test plants garbage there). A draft
chain extends that sequence with the layer's own (un-normed) output and its argmax. Every draft
the runner proposes (prompt in one chunk or several, a prefix-cache hit, k = 1 and 3, and after
drafts were accepted in part) must be that reference's. With MTP on, greedy output is the output
with speculation off (k = 1..3, chunked prefill, prefix hits, preemption), and ``resin serve``
drafts with it.

The random MTP layer's own drafts are almost never accepted, so one test hands the engine
drafts that are right up to a point (the known greedy continuation, then a wrong token): the
accepted and rejected positions of a verify row, and the MTP caches after them, are exercised.
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
from resin.evals.model_ref import import_model_module  # noqa: E402
from resin.llm import LLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "deepseek_v3"
TINY = MODEL_DIR / "tiny"
RUNNER = str(MODEL_DIR)
PROMPTS = [list(range(5, 50)), [9, 8, 7] * 7 + list(range(100, 122)), [3] * 13]
N = 4  # tiny/'s num_hidden_layers: the MTP layer is model.layers.4.*
OWN = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")
COPIES = (f"model.layers.{N}.embed_tokens.weight", f"model.layers.{N}.shared_head.head.weight")
pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    # the MTP layer's copies of the target's embedding and head: left unused at each load
    pytest.mark.filterwarnings("ignore:.*the model does not use:UserWarning"),
]


def _hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _copy(tmp_path: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    path = tmp_path / "deepseek_v3"
    shutil.copytree(TINY, path)
    if edit is not None:
        config = json.loads((path / "config.json").read_text())
        edit(config)
        (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def no_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with ``num_nextn_predict_layers`` 0 (its next-n layer then unused)."""
    return _copy(
        tmp_path_factory.mktemp("dsv3_no_mtp"), lambda c: c.update(num_nextn_predict_layers=0)
    )


def test_the_mtp_layer_loads_past_the_stack(no_mtp: Path) -> None:
    from safetensors.torch import load_file

    llm = LLM(TINY, runner=RUNNER, max_num_seqs=2)
    runner = llm.runner
    mtp = runner.model.mtp
    assert mtp is not None and len(mtp.layers) == 1 and len(runner.model.layers) == N
    layer = mtp.layers[0]
    assert (layer.index, layer.layer_type) == (N, "full_attention")
    assert layer.cache.buffers == runner.model.layers[-1].cache.buffers  # MLA's latent
    assert len(runner.weights.layers) == N + 1
    weights = runner.weights.layers[N]
    assert "mlp.gate.e_score_correction_bias" in weights and "mlp.experts.7.up_proj.weight" in (
        weights
    )
    assert "self_attn.q_a_proj.weight" in weights
    assert set(runner.weights.module(N, "mtp")) == set(OWN)
    # its copies of the target's embedding and head are not read (the target's are used)
    assert runner.weights.unused == sorted(COPIES)
    tensors = load_file(str(TINY / "model.safetensors"))
    assert torch.equal(tensors[COPIES[0]], tensors["model.embed_tokens.weight"])
    assert torch.equal(tensors[COPIES[1]], tensors["lm_head.weight"])
    # Off by default: no MTP caches in the pool.
    off = LLM(no_mtp, runner=RUNNER).runner
    assert off.model.mtp is None and len(runner.cache_spec()) == len(off.cache_spec())


def test_mtp_needs_a_checkpoint_that_ships_it(no_mtp: Path) -> None:
    with pytest.raises(ValueError, match="no MTP layer"):
        LLM(no_mtp, runner=RUNNER, speculative_method="mtp")


@pytest.mark.parametrize(
    "name",
    ["self_attn.kv_b_proj.weight", "mlp.gate.e_score_correction_bias", "eh_proj.weight"],
)
def test_a_missing_mtp_tensor_is_named(tmp_path: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    from resin.loading.weights import WeightsError

    path = _copy(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[f"model.layers.{N}.{name}"]
    save_file(tensors, str(path / "model.safetensors"))
    pattern = rf"MTP layer 0 is missing tensor\(s\) model\.layers\.{N}\.{re.escape(name)}"
    with pytest.raises(WeightsError, match=pattern):
        LLM(path, runner=RUNNER)


def test_the_mtp_layer_kind_follows_vllm_s_rule() -> None:
    """vLLM's ``DeepseekV2DecoderLayer`` at index ``num_hidden_layers``: a MoE from
    ``first_k_dense_replace`` on, every ``moe_layer_freq``-th layer."""
    from resin.runners.torch.model_dir import ModelArgs

    blocks = import_model_module(MODEL_DIR, "blocks", "deepseek_v3")
    config = json.loads((TINY / "config.json").read_text())

    def kind(**edit: Any) -> str:
        args = ModelArgs(**{**config, **edit})
        return f"{blocks.mtp_layer_type(args)}/{blocks.mtp_mlp_type(args)}"

    assert kind() == "full_attention/moe"
    assert kind(first_k_dense_replace=4) == "full_attention/moe"
    assert kind(first_k_dense_replace=5) == "full_attention/dense"
    assert kind(moe_layer_freq=3) == "full_attention/dense"
    assert kind(moe_layer_freq=2) == "full_attention/moe"
    assert blocks.mtp_hidden_shape(ModelArgs(**config)) == (config["hidden_size"],)


# -- the drafts against a reference built from transformers' modules ----------------------


class Reference:
    """The MTP layer's greedy draft chain for a token sequence, computed with HF modules (see
    the module doc)."""

    def __init__(self, tmp: Path):
        from safetensors.torch import load_file, save_file
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        self.target = _hf(TINY)
        tensors = load_file(str(TINY / "model.safetensors"))
        config = json.loads((TINY / "config.json").read_text())
        prefix = f"model.layers.{N}."
        w = {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
        own = ("eh_proj.", "enorm.", "hnorm.", "shared_head.", "embed_tokens.")
        layer = {"model.layers.0." + k: t for k, t in w.items() if not k.startswith(own)}
        layer |= {k: t for k, t in tensors.items() if not k.startswith("model.layers.")}
        layer["model.norm.weight"] = w["shared_head.norm.weight"]
        save_file(layer, str(tmp / "model.safetensors"))
        # one MoE layer (the MTP layer's index is past first_k_dense_replace)
        config.update(num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0)
        (tmp / "config.json").write_text(json.dumps(config))
        self.mtp = _hf(tmp)
        hidden, eps = int(config["hidden_size"]), float(config["rms_norm_eps"])
        self.enorm, self.hnorm = DeepseekV3RMSNorm(hidden, eps), DeepseekV3RMSNorm(hidden, eps)
        self.enorm.weight.data.copy_(w["enorm.weight"])
        self.hnorm.weight.data.copy_(w["hnorm.weight"])
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.eh_proj.weight.data.copy_(w["eh_proj.weight"])
        self.cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def _inputs(self, prev: Any, tokens: Any) -> Any:
        e = self.enorm(self.target.model.embed_tokens(tokens))
        return self.eh_proj(torch.cat([e, self.hnorm(prev)], dim=-1))

    def drafts(self, ids: list[int], k: int) -> list[int]:
        """Greedy drafts after ``ids`` (its last token the one the engine just committed)."""
        key = (tuple(ids), k)
        if key in self.cache:
            return self.cache[key]
        seen: dict[str, Any] = {}
        hook = self.mtp.model.layers[0].register_forward_hook(
            lambda m, a, out: seen.update(y=out[0] if isinstance(out, tuple) else out)
        )
        out: list[int] = []
        with torch.no_grad():
            h = self.target.model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # normed
            # vLLM's MTP sequence: the entries at positions 1.. (h[s-1], t[s]), none at 0
            e = self.target.model.embed_tokens(torch.tensor(ids[1:]))
            e[0] = 0  # vLLM's "masking inputs at position 0": its position 0 is Resin's 1
            x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h[:-1])], dim=-1))
            for _ in range(k):
                positions = torch.arange(1, x.shape[0] + 1)[None]
                logits = self.mtp(inputs_embeds=x[None], position_ids=positions).logits[0, -1]
                token = int(logits.argmax(-1))
                out.append(token)
                y = seen["y"][0, -1:]  # the layer's output before shared_head.norm
                x = torch.cat([x, self._inputs(y, torch.tensor([token]))])
        hook.remove()
        self.cache[key] = out
        return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return Reference(tmp_path_factory.mktemp("dsv3_mtp_reference"))


Record = tuple[int, int, list[int]]


def _record_drafts(
    llm: LLM, replace: Callable[[int, int, list[int]], list[int]] | None = None
) -> list[Record]:
    """(bonus position, bonus token, drafts) of every drafting row, as the MTP layer proposes
    them; with ``replace`` the engine gets ``replace(position, bonus, drafts)`` instead."""
    drafter = llm.runner.drafter
    records: list[Record] = []
    chain = drafter._chain

    def recording(step, cached, hidden, bonus, rows, last):  # type: ignore[no-untyped-def]
        drafts = chain(step, cached, hidden, bonus, rows, last)
        positions = step.positions[torch.as_tensor(last)] + 1
        out = drafts.copy()
        for r, (p, b, d) in enumerate(zip(positions.tolist(), bonus.tolist(), drafts.tolist())):
            records.append((p, b, d))
            if replace is not None:
                out[r] = replace(p, b, d)
        return out

    drafter._chain = recording
    return records


def _check_records(
    records: list[Record], sequences: list[list[int]], reference: Reference, k: int
) -> None:
    for position, bonus, drafts in records:
        # the sequence this row belongs to: one whose token at `position` is the bonus
        owners = [s for s in sequences if len(s) > position and s[position] == bonus]
        assert owners, (position, bonus)
        assert any(reference.drafts(s[: position + 1], k) == drafts for s in owners), (
            position,
            drafts,
        )


@pytest.mark.parametrize(
    "k, engine",
    [(1, {}), (3, {"max_num_batched_tokens": 14})],  # one chunk / chunks not page-aligned
)
def test_every_draft_is_the_reference_mtp_layer_s(
    reference: Reference, k: int, engine: dict[str, Any]
) -> None:
    params = resin.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(
        TINY,
        runner=RUNNER,
        max_num_seqs=2,
        speculative_method="mtp",
        num_speculative_tokens=k,
        page_size=4,
        **engine,
    )
    records = _record_drafts(llm)
    outs = llm.generate(PROMPTS[:2], params)
    again = llm.generate([PROMPTS[0][:41] + [7, 7]], params)  # a prefix hit (10 pages)
    assert again[0].num_cached_tokens > 0
    sequences = [o.prompt_token_ids + o.token_ids for o in outs + again]
    assert len(records) >= 3 * (params.max_tokens // (k + 1))
    _check_records(records, sequences, reference, k)


def _planted_at(position: int, llm: LLM) -> None:
    """The MTP layer's input at ``position`` (the cache pass's; a draft step is never there)
    replaced by seeded garbage, so what its caches hold there is garbage too."""
    definition = llm.runner.drafter.definition
    original = definition.input

    def planted(prev: Any, embeds: Any, w: Any, ctx: Any) -> Any:
        x = original(prev, embeds, w, ctx)
        at = (ctx.positions == position).view(-1, *[1] * (x.dim() - 1))
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(position))
        return torch.where(at, 10 * noise.to(x.dtype), x)

    definition.input = planted


def test_no_draft_attends_position_0() -> None:
    """Position 0's entry (a zero input: no ``h[-1]``) is no entry of vLLM's MTP sequence, so
    no draft may see it: garbage planted there changes no draft, while garbage planted at
    position 1 (vLLM's first entry) does. Fails if position 0 becomes visible again."""
    params = resin.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    def drafts(plant: int | None) -> list[Record]:
        llm = LLM(
            TINY,
            runner=RUNNER,
            max_num_seqs=2,
            speculative_method="mtp",
            num_speculative_tokens=3,
            page_size=4,
            max_num_batched_tokens=14,
        )
        records = _record_drafts(llm)
        if plant is not None:
            _planted_at(plant, llm)
        llm.generate(PROMPTS[:2], params)
        return records

    clean = drafts(None)
    assert len(clean) >= 6
    assert drafts(0) == clean
    assert drafts(1) != clean  # the plant reaches the drafts wherever they may look


def test_draft_attention_hides_position_0_in_every_cache() -> None:
    """``DraftAttention``'s view of a cache: position 0 hidden (with and without a window, in
    ``gather`` and ``attend``), a compressed entry (closed at ``ratio - 1``) kept, and a chain
    starting at position 1 attends its own key alone."""
    import numpy as np

    from resin.runners.torch.attention import RowHistory
    from resin.runners.torch.mtp_drafter import DraftAttention

    class Cached:  # the cache pass's view of one row
        def __init__(self, positions: list[int], values: Any):
            self.row = RowHistory(slice(0, 1), torch.tensor(positions), values, torch.ones(1, 1))

        def gather(self, name: str) -> list[RowHistory]:
            return [self.row]

    def view(positions: list[int], values: Any, first: int, **kw: Any) -> DraftAttention:
        return DraftAttention(Cached(positions, values), np.array([0]), torch.tensor([first]), **kw)

    values = torch.randn(6, 1, 8, generator=torch.Generator().manual_seed(0))
    for window, seen in ((None, [1, 2, 3, 4, 5]), (4, [3, 4, 5]), (6, [1, 2, 3, 4, 5])):
        hist = view(list(range(6)), values, 6, window=window).gather("k")[0]
        assert hist.positions[hist.mask[0]].tolist() == seen, window
    # compressed entries (ratio 4: closed at 3 and 7) are positions > 0: both visible
    hist = view([3, 7], values[:2], 8, window=None, ratio=4).gather("k")[0]
    assert hist.mask[0].tolist() == [True, True]
    # attend: position 0's value changes nothing; written keys join (K = V here)
    q, own = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    outs = []
    for garbage in (0.0, 100.0):
        planted = values.clone()
        planted[0] = garbage
        attention = view(list(range(6)), planted, 6, window=None)
        outs.append(attention(q, own, own, scale=0.5))
    assert torch.equal(outs[0], outs[1])
    # a chain at position 1 (after a one-token prompt): its own key alone
    attention = view([0], values[:1] * 100, 1, window=None)
    assert torch.allclose(attention(q, own, own, scale=0.5), own.expand(1, 2, 8))


def _metric(llm: LLM, name: str, labels: str = "") -> float:
    match = re.search(rf"^resin:{name}(?:\{{{labels}\}})? (\S+)", llm.engine.metrics_text(), re.M)
    assert match, name
    return float(match.group(1))


def test_partly_accepted_drafts_keep_output_and_mtp_state_exact(reference: Reference) -> None:
    """The engine gets the true greedy continuation as drafts, wrong from a draft chosen by
    the bonus token and its position on: rows accept 0..3 drafts. Output is the output
    without speculation, and every draft the MTP layer proposes afterwards (read from its
    caches up to the last accepted position) is still the reference's."""
    k = 3
    params = resin.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    base: dict[str, Any] = {"max_num_seqs": 2, "max_model_len": 96, "runner": RUNNER}
    prompts = PROMPTS[:2]
    off = LLM(TINY, **base).generate(prompts, params)
    sequences = [o.prompt_token_ids + o.token_ids for o in off]
    vocab = int(json.loads((TINY / "config.json").read_text())["vocab_size"])

    def oracle(position: int, bonus: int, drafts: list[int]) -> list[int]:
        owner = next(s for s in sequences if len(s) > position and s[position] == bonus)
        right = (7 * position + bonus) % (k + 1)  # drafts right before the first wrong one
        out = []
        for i in range(k):
            p = position + 1 + i
            true = owner[p] if p < len(owner) else 0
            out.append(true if i < right else (true + 1) % vocab)
        return out

    llm = LLM(TINY, speculative_method="mtp", num_speculative_tokens=k, page_size=4, **base)
    records = _record_drafts(llm, oracle)
    on = llm.generate(prompts, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    accepted = [
        _metric(llm, "spec_decode_num_accepted_tokens_per_pos_total", f'position="{i}"')
        for i in range(k)
    ]
    assert accepted[0] > accepted[1] > 0 and accepted[2] > 0, accepted
    _check_records(records, sequences, reference, k)


def test_greedy_is_identical_with_mtp_speculation() -> None:
    params = resin.SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    base: dict[str, Any] = {"max_num_seqs": 3, "max_model_len": 96, "runner": RUNNER}
    off = [o.token_ids for o in LLM(TINY, **base).generate(PROMPTS, params)]
    cases: list[tuple[int, dict[str, Any]]] = [
        (1, {"num_pages": 600}),
        (2, {"max_num_batched_tokens": 9, "num_pages": 600}),  # chunked prefill
        (3, {"page_size": 4, "max_num_batched_tokens": 16, "num_pages": 150}),  # preemption
    ]
    for k, engine in cases:
        llm = LLM(TINY, speculative_method="mtp", num_speculative_tokens=k, **base, **engine)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == off, (k, engine)
        assert _metric(llm, "spec_decode_num_drafts_total") > 0
        if "page_size" in engine:
            assert _metric(llm, "num_preemptions_total") > 0
        else:
            again = llm.generate(PROMPTS, params)  # prefix hits
            assert [o.token_ids for o in again] == off
            assert sum(o.num_cached_tokens for o in again) > 0, (k, engine)


def test_resin_serve_drafts_with_mtp(no_mtp: Path) -> None:
    """``resin serve --speculative-method mtp``: the same answer as without speculation, the
    drafts counted on /metrics; a checkpoint without the layer is refused with a clear error."""
    import httpx
    import openai
    from typer.testing import CliRunner

    from resin.cli import app
    from resin.server.context import ServerOptions
    from resin.server.serve import build_context
    from tests.server_harness import LiveServer

    expected = LLM(TINY, runner=RUNNER, max_num_seqs=2, max_model_len=256).generate(
        ["Count to ten."], resin.SamplingParams(max_tokens=12, temperature=0.0)
    )[0]
    ctx = build_context(
        TINY,
        runner=RUNNER,
        options=ServerOptions(served_model_names=["dsv3"]),
        max_num_seqs=2,
        max_model_len=256,
        speculative_method="mtp",
        num_speculative_tokens=2,
    )
    with LiveServer(ctx) as live:
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0)
        done = client.completions.create(
            model="dsv3", prompt="Count to ten.", max_tokens=12, temperature=0
        )
        assert done.choices[0].text == expected.text
        metrics = httpx.get(f"{live.base_url}/metrics").text
        assert re.search(r"^resin:spec_decode_num_drafts_total [1-9]", metrics, re.M)
    result = CliRunner().invoke(app, ["serve", str(no_mtp), "--speculative-method", "mtp"])
    assert result.exit_code == 2 and "no MTP layer" in result.output
