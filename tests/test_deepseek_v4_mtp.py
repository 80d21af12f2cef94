"""DeepSeek-V4 as DeepSeek ships it — hub tensor names, legacy config keys, an MTP layer — and
that MTP layer drafting for speculative decoding.

The checkpoint is the committed tiny one rewritten by ``source/make_upstream.py``; transformers
is the judge of the format (its legacy config parses to the tiny config, ``from_pretrained``
reads the tensors back to the tiny weights and ignores ``mtp.*``), Resin must read it too.

transformers builds no MTP layer, so the drafts are checked against one assembled from its
modules: a one-layer ``DeepseekV4ForCausalLM`` whose layer 0 holds ``mtp.0``'s decoder tensors
(sliding attention, top-k MoE — HF's own math for them), fed the MTP input of DeepSeek's
``MTPBlock`` (``e_proj(enorm(embed(t[s]))) + h_proj(hnorm(h[s-1]))``, ``h`` the target's
last-layer streams from HF's full forward; the embedding zeroed at position 1, as vLLM's
``deepseek_v4_mtp.py`` masks its position 0) and read out by the MTP hyper-head and norm. The
reference's MTP sequence is vLLM's: entries ``s = 1, 2, ...`` only (vLLM's ``(h[p], t[p+1])`` at
``p = s - 1``; ``position_ids`` from 1, the same sliding attention, RoPE being relative), no
entry at position 0, which the runner writes from a zero input but lets no draft attend
(``mtp_drafter``). A draft chain extends that sequence with the layer's own output streams and
its argmax. Every
draft the runner proposes, at every step (prompt in one chunk or several, a prefix-cache hit),
must be that reference's. With MTP on, greedy output is the output with speculation off
(k = 1..4, chunked prefill, preemption, prefix hits).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import resin  # noqa: E402
from resin.evals.model_ref import import_model_module  # noqa: E402
from resin.llm import LLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "resin" / "models" / "deepseek_v4_flash"
TINY = MODEL_DIR / "tiny"
RUNNER = str(MODEL_DIR)
PROMPTS = [list(range(5, 60)), [9, 8, 7] * 7 + list(range(100, 130)), [3] * 12]
pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore:.*checkpoint tensor"),
]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    make = import_model_module(MODEL_DIR / "source", "make_upstream", "dsv4_make_upstream")
    return make.write_upstream(TINY, tmp_path_factory.mktemp("dsv4_upstream"))


def _hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def test_transformers_reads_the_hub_layout_as_the_tiny_checkpoint(upstream: Path) -> None:
    from transformers import AutoConfig

    names = set(json.loads(upstream.joinpath("config.json").read_text()))
    assert {"compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling"} <= names
    assert "layer_types" not in names and "rope_parameters" not in names
    tiny, hub = AutoConfig.from_pretrained(TINY), AutoConfig.from_pretrained(upstream)
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor"):
        assert getattr(hub, key) == getattr(tiny, key), key
    strip = lambda rope: {k: {n: v for n, v in t.items() if n != "type"} for k, t in rope.items()}  # noqa: E731
    assert strip(hub.rope_parameters) == strip(tiny.rope_parameters)
    a, b = _hf(TINY).state_dict(), _hf(upstream).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_normalise_config_derives_what_transformers_derives(upstream: Path) -> None:
    from transformers import AutoConfig

    from resin.runners.torch.model_dir import ModelRecord, load_model_args

    blocks = import_model_module(MODEL_DIR, "blocks", "deepseek_v4_flash")
    args = blocks.normalise_config(load_model_args(upstream, ModelRecord.load(MODEL_DIR)).to_dict())
    hub = AutoConfig.from_pretrained(upstream)
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "qk_rope_head_dim"):
        assert args[key] == getattr(hub, key), key
    for table in ("main", "compress"):
        want = {k: v for k, v in hub.rope_parameters[table].items() if k != "type"}
        assert args["rope_parameters"][table] == want
    with pytest.raises(ValueError, match="unknown ratio"):
        blocks.normalise_config({**args, "layer_types": None, "compress_ratios": [0, 4, 16, 0, 0]})


def test_resin_runs_the_hub_layout_and_loads_the_mtp_layer(upstream: Path) -> None:
    params = resin.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tiny = LLM(TINY, runner=RUNNER, max_num_seqs=2).generate(PROMPTS[:2], params)
    llm = LLM(upstream, runner=RUNNER, max_num_seqs=2)
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], params)] == [o.token_ids for o in tiny]
    runner = llm.runner
    assert runner.model.mtp is not None and len(runner.weights.layers) == 5
    assert {"e_proj.weight", "hc_head.hc_fn"} <= set(runner.weights.module(4, "mtp"))
    assert not [n for n in runner.weights.unused if n.startswith("mtp.")]
    # Off by default: no MTP caches in the pool.
    assert len(runner.cache_spec()) == len(LLM(TINY, runner=RUNNER).runner.cache_spec())


def test_mtp_needs_a_checkpoint_that_ships_it() -> None:
    with pytest.raises(ValueError, match="no MTP layer"):
        LLM(TINY, runner=RUNNER, speculative_method="mtp")
    with pytest.raises(ValueError, match="speculative method"):
        LLM(TINY, runner=RUNNER, speculative_method="eagle")


def test_a_missing_mtp_tensor_is_named(upstream: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from resin.loading.weights import WeightsError

    for f in upstream.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(upstream / "model.safetensors"))
    del tensors["mtp.0.attn.wkv.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"MTP layer 0 is missing tensor\(s\) mtp\.0\.attn\.wkv"):
        LLM(tmp_path, runner=RUNNER)


# -- the drafts against a reference built from transformers' modules ----------------------


class Reference:
    """The MTP layer's greedy draft chain for a token sequence, computed with HF modules (see
    the module doc)."""

    def __init__(self, upstream: Path, tmp: Path):
        from safetensors.torch import load_file, save_file

        self.target = _hf(TINY)
        tensors = load_file(str(upstream / "model.safetensors"))
        own = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.", "hc_head_")
        self.w = {n[6:]: t for n, t in tensors.items() if n.startswith("mtp.0.")}
        layer = {"layers.0." + n: t for n, t in self.w.items() if not n.startswith(own)} | {
            n: t for n, t in tensors.items() if not n.startswith(("mtp.", "layers."))
        }
        save_file(layer, str(tmp / "model.safetensors"))
        config = json.loads((upstream / "config.json").read_text())
        config.update(num_hidden_layers=1, compress_ratios=[0, 0], num_hash_layers=0)
        config["num_nextn_predict_layers"] = 0
        (tmp / "config.json").write_text(json.dumps(config))
        self.mtp = _hf(tmp)
        self.config = self.mtp.config

    def _streams(self, ids: list[int]) -> torch.Tensor:
        """The target's last-layer hyper-connection streams [T, hc, D] (HF full forward)."""
        seen: dict[str, torch.Tensor] = {}
        layer = self.target.model.layers[-1]
        hook = layer.register_forward_hook(lambda m, a, out: seen.update(h=out))
        with torch.no_grad():
            self.target(torch.tensor([ids]))
        hook.remove()
        return seen["h"][0]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return weight * (
            x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        )

    def _inputs(self, prev: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """``MTPBlock``: e_proj(enorm(e)) broadcast over the streams + h_proj(hnorm(h))."""
        e = self._norm(embeds, self.w["enorm.weight"]) @ self.w["e_proj.weight"].T
        h = self._norm(prev, self.w["hnorm.weight"]) @ self.w["h_proj.weight"].T
        return e[:, None, :] + h

    def _logits(self, streams: torch.Tensor) -> torch.Tensor:
        flat = streams.flatten(1).float()
        flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        mix = flat @ self.w["hc_head_fn"].T
        pre = torch.sigmoid(mix * self.w["hc_head_scale"] + self.w["hc_head_base"])
        pre = pre + self.config.hc_eps
        out = (pre[..., None] * streams).sum(1)
        return self.target.lm_head(self._norm(out, self.w["norm.weight"]))

    def drafts(self, ids: list[int], k: int) -> list[int]:
        """Greedy drafts after ``ids`` (its last token the one the engine just committed)."""
        h = self._streams(ids)
        # vLLM's MTP sequence: the entries at positions 1.. (h[s-1], t[s]), none at 0
        e = self.target.model.embed_tokens(torch.tensor(ids[1:]))
        e[0] = 0  # vLLM's "masking inputs at position 0": its position 0 is Resin's 1
        x = self._inputs(h[:-1], e)
        out: list[int] = []
        seen: dict[str, torch.Tensor] = {}
        for _ in range(k):
            layer = self.mtp.model.layers[0]
            pre = layer.register_forward_pre_hook(_replace_input(x[None]), with_kwargs=True)
            post = layer.register_forward_hook(lambda m, a, o: seen.update(y=o))
            positions = torch.arange(1, x.shape[0] + 1)[None]
            with torch.no_grad():  # ids unused: layer 0's input is x
                self.mtp(positions, position_ids=positions)
            pre.remove(), post.remove()
            y = seen["y"][0]
            token = int(self._logits(y[-1:]).argmax(-1))
            out.append(token)
            e = self.target.model.embed_tokens(torch.tensor([token]))
            x = torch.cat([x, self._inputs(y[-1:], e)])
        return out


def _replace_input(hidden: torch.Tensor) -> Any:
    """A forward pre-hook giving a decoder layer ``hidden`` as its input streams."""

    def hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": hidden}
        return (hidden, *args[1:]), kwargs

    return hook


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


@pytest.mark.parametrize(
    "k, engine",
    [(1, {}), (3, {"max_num_batched_tokens": 16})],  # one chunk / chunks not page-aligned
)
def test_every_draft_is_the_reference_mtp_layer_s(
    upstream: Path, tmp_path: Path, k: int, engine: dict[str, Any]
) -> None:
    reference = Reference(upstream, tmp_path)
    params = resin.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(
        upstream,
        runner=RUNNER,
        max_num_seqs=2,
        speculative_method="mtp",
        num_speculative_tokens=k,
        page_size=4,
        **engine,
    )
    records = _record_drafts(llm)
    # (a 3-token prompt: its first chains' sliding window (8) holds positions 0 and 1)
    outs = llm.generate([*PROMPTS[:2], [11, 12, 13]], params)
    again = llm.generate([PROMPTS[0][:41] + [7, 7]], params)  # a prefix hit (10 pages)
    assert again[0].num_cached_tokens > 0
    sequences = [o.prompt_token_ids + o.token_ids for o in outs + again]
    assert len(records) >= 3 * (params.max_tokens // (k + 1))
    for position, bonus, drafts in records:
        # the sequence this row belongs to: the one whose token at `position` is the bonus
        owners = [s for s in sequences if len(s) > position and s[position] == bonus]
        assert owners, (position, bonus)
        assert any(reference.drafts(s[: position + 1], k) == drafts for s in owners), (
            position,
            drafts,
        )


def _metric(llm: LLM, name: str) -> float:
    match = re.search(rf"^resin:{name}(?:\{{\}})? (\S+)", llm.engine.metrics_text(), re.M)
    assert match, name
    return float(match.group(1))


def test_greedy_is_identical_with_mtp_speculation(upstream: Path) -> None:
    params = resin.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    base = {"max_num_seqs": 3, "max_model_len": 96, "runner": RUNNER}
    off = [o.token_ids for o in LLM(upstream, **base).generate(PROMPTS, params)]
    for k, engine in [
        (1, {"num_pages": 400}),  # (room to keep the first round's pages cached)
        (2, {"max_num_batched_tokens": 9, "num_pages": 400}),  # chunked prefill; verify
        # rows cut to the budget
        (4, {"page_size": 4, "max_num_batched_tokens": 16, "num_pages": 90}),  # preemption
    ]:
        llm = LLM(upstream, speculative_method="mtp", num_speculative_tokens=k, **base, **engine)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == off, (k, engine)
        assert _metric(llm, "spec_decode_num_drafts_total") > 0
        if engine["num_pages"] < 100:
            assert _metric(llm, "num_preemptions_total") > 0
        else:
            again = llm.generate(PROMPTS, params)  # prefix hits
            assert [o.token_ids for o in again] == off
            assert sum(o.num_cached_tokens for o in again) > 0, (k, engine)


def test_resin_serve_drafts_with_mtp(upstream: Path) -> None:
    """``resin serve --speculative-method mtp``: the same answer as without speculation, the
    drafts counted on /metrics; a checkpoint without MTP tensors is refused with a clear error."""
    import openai
    from typer.testing import CliRunner

    from resin.cli import app
    from resin.server.context import ServerOptions
    from resin.server.serve import build_context
    from tests.server_harness import LiveServer

    messages = [{"role": "user", "content": "Count to ten."}]
    expected = LLM(upstream, runner=RUNNER, max_num_seqs=2, max_model_len=256).chat(
        messages, resin.SamplingParams(max_tokens=12, temperature=0.0), thinking=False
    )[0]
    ctx = build_context(
        upstream,
        runner=RUNNER,
        options=ServerOptions(served_model_names=["dsv4"]),
        max_num_seqs=2,
        max_model_len=256,
        speculative_method="mtp",
        num_speculative_tokens=2,
    )
    with LiveServer(ctx) as live:
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(
            model="dsv4",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0,
            extra_body={"chat_template_kwargs": {"thinking": False}},
        )
        assert chat.choices[0].message.content == expected.text
        import httpx

        metrics = httpx.get(f"{live.base_url}/metrics").text
        assert re.search(r"^resin:spec_decode_num_drafts_total [1-9]", metrics, re.M)
    result = CliRunner().invoke(app, ["serve", str(TINY), "--speculative-method", "mtp"])
    assert result.exit_code == 2 and "no MTP layer" in result.output


def test_seeded_sampling_is_identical_with_mtp_speculation(upstream: Path) -> None:
    """The MTP drafts are verified like any drafter's: seeded sampled output (and its
    logprobs) with MTP on is the output with speculation off."""
    params = [
        resin.SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=s, logprobs=2)
        for s in (1, 2, 3)
    ]
    base = {"max_num_seqs": 3, "max_model_len": 96, "runner": RUNNER}
    off = LLM(upstream, **base).generate(PROMPTS, params)
    llm = LLM(upstream, speculative_method="mtp", num_speculative_tokens=3, **base)
    on = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    for a, b in zip(on, off):
        assert a.logprobs is not None and b.logprobs is not None
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x)
    assert _metric(llm, "spec_decode_num_drafts_total") > 0
