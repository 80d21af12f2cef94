"""Broken checkpoints are refused at load, with a ConfigError / WeightsError naming the file,
the tensor or the field, never a raw library traceback or a failure at the first forward:

- ``model.safetensors.index.json``: a tensor pointed at a shard without it; a null entry or a
  list for ``weight_map``;
- shards: a truncated one, in the built-in loader and in a model directory's;
- tensor dtypes: int8, fp8 (no ``quantization_config``) and bool are refused in both
  loaders; float64 is cast; a block-scaled FP8 checkpoint loads dequantised in the built-in
  families too (an unsupported ``quantization_config`` is refused, naming it);
- a model directory's shapes: q_proj rows, KV heads not dividing the heads, head_dim, vocab
  size and intermediate size that do not match the tensors;
- config.json: Mixtral with more experts per token than experts, rope factors <= 0, llama3's
  equal band edges, ``architectures`` and ``model_type`` naming two families, an unknown
  ``dtype``; ``generation_config.json`` fields of the wrong type or out of range.

Every case copies a bundled tiny checkpoint (tests/fixtures/llama, models/gemma3/tiny) into
tmp_path and edits one thing.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

import resin  # noqa: E402
from resin.loading import ConfigError, load_model_config  # noqa: E402
from resin.loading.generation_config import check_generation_config  # noqa: E402
from resin.loading.weights import WeightsError, load_weights  # noqa: E402
from resin.registry import ModelRegistry  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LLAMA = REPO / "tests" / "fixtures" / "llama"
MIXTRAL = REPO / "tests" / "fixtures" / "mixtral"
GEMMA3 = REPO / "resin" / "models" / "gemma3"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def copy_of(source: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    return Path(shutil.copytree(source, tmp_path / name))


def edit_config(directory: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def edit_tensors(directory: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def shard_in_two(directory: Path) -> dict[str, str]:
    """Split model.safetensors into two shards plus an index; the index's weight_map."""
    tensors = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    weight_map: dict[str, str] = {}
    names = sorted(tensors)
    for i in range(2):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        part = {n: tensors[n] for n in names[i::2]}
        save_file(part, str(directory / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    write_index(directory, weight_map)
    return weight_map


def write_index(directory: Path, weight_map: Any) -> None:
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def load_builtin(directory: Path) -> Any:
    return load_weights(directory, load_model_config(directory))


def load_model_dir(directory: Path) -> Any:
    return (
        ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(directory).load_runner(directory)
    )


# -- 1, 2: the shard index ---------------------------------------------------------------------


def test_index_pointing_a_tensor_at_the_wrong_shard_names_index_shard_and_tensor(
    tmp_path: Path,
) -> None:
    ckpt = copy_of(LLAMA, tmp_path)
    weight_map = shard_in_two(ckpt)
    other = {s for s in weight_map.values() if s != weight_map[Q_PROJ]}.pop()
    write_index(ckpt, {**weight_map, Q_PROJ: other})
    with pytest.raises(WeightsError, match=rf"index\.json: .*{Q_PROJ} in shard {other}"):
        load_builtin(ckpt)


@pytest.mark.parametrize(
    "weight_map,error",
    [
        ({Q_PROJ: None}, rf"index\.json: weight_map entry '{Q_PROJ}' must name a shard"),
        (["a", "b"], r"index\.json: 'weight_map' must be an object .*got list"),
    ],
)
def test_malformed_weight_map_is_named(tmp_path: Path, weight_map: Any, error: str) -> None:
    ckpt = copy_of(LLAMA, tmp_path)
    (ckpt / "model.safetensors").unlink()
    write_index(ckpt, weight_map)
    with pytest.raises(WeightsError, match=error):
        load_builtin(ckpt)


# -- 3: unreadable shards in the model-directory loader ---------------------------------------


def test_model_directory_truncated_shard_is_a_weights_error(tmp_path: Path) -> None:
    ckpt = copy_of(GEMMA3 / "tiny", tmp_path)
    shard_in_two(ckpt)
    shard = ckpt / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(WeightsError, match=r"cannot open .*model-00002-of-00002\.safetensors"):
        load_model_dir(ckpt)


def test_model_directory_index_pointing_at_the_wrong_shard(tmp_path: Path) -> None:
    ckpt = copy_of(GEMMA3 / "tiny", tmp_path)
    weight_map = shard_in_two(ckpt)
    other = {s for s in weight_map.values() if s != weight_map[Q_PROJ]}.pop()
    write_index(ckpt, {**weight_map, Q_PROJ: other})
    with pytest.raises(WeightsError, match=rf"weight_map puts tensor {Q_PROJ} in shard {other}"):
        load_model_dir(ckpt)


# -- 4: tensor dtypes ---------------------------------------------------------------------------

NON_FLOAT = {
    "I8": lambda t: (t * 100).to(torch.int8),
    "F8_E4M3": lambda t: t.to(torch.float8_e4m3fn),
    "BOOL": lambda t: t > 0,
}


@pytest.mark.parametrize("header_dtype", sorted(NON_FLOAT))
@pytest.mark.parametrize("loader", ["builtin", "model_dir"])
def test_non_float_tensors_are_refused_by_name(
    tmp_path: Path, header_dtype: str, loader: str
) -> None:
    ckpt = copy_of(LLAMA if loader == "builtin" else GEMMA3 / "tiny", tmp_path)
    edit_tensors(ckpt, lambda t: t.update({Q_PROJ: NON_FLOAT[header_dtype](t[Q_PROJ])}))
    with pytest.raises(WeightsError, match=rf"tensor {Q_PROJ} has dtype {header_dtype}"):
        (load_builtin if loader == "builtin" else load_model_dir)(ckpt)


def test_float64_tensors_are_cast(tmp_path: Path) -> None:
    ckpt = copy_of(LLAMA, tmp_path)
    edit_tensors(ckpt, lambda t: t.update({Q_PROJ: t[Q_PROJ].double()}))
    assert load_builtin(ckpt)[Q_PROJ].dtype == torch.float32


def test_an_unsupported_quantization_is_refused_by_the_builtin_families(tmp_path: Path) -> None:
    ckpt = copy_of(LLAMA, tmp_path)
    edit_config(ckpt, lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4}))
    with pytest.raises(WeightsError, match=r"quant_method 'awq' is not supported"):
        load_builtin(ckpt)


def fp8_quantised(source: Path, tmp_path: Path, block: int = 16) -> tuple[Path, Path]:
    """(an FP8 block-scaled copy of ``source``, as Qwen3-*-FP8 ships: every layer projection in
    float8_e4m3fn with a float32 ``weight_scale_inv`` per block, the rest as it was; the same
    checkpoint with those weights dequantised to float32, the reference)."""
    quantised, reference = copy_of(source, tmp_path, "fp8"), copy_of(source, tmp_path, "ref")
    tensors = load_file(str(source / "model.safetensors"))
    packed, plain = dict(tensors), dict(tensors)
    for name, weight in tensors.items():
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            continue
        rows, cols = weight.shape
        grid = (-(-rows // block), -(-cols // block))
        scale = torch.zeros(grid)
        codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        for i in range(grid[0]):
            for j in range(grid[1]):
                part = weight[i * block : (i + 1) * block, j * block : (j + 1) * block]
                scale[i, j] = part.abs().max().clamp(min=1e-12) / 448.0 * (1 + (i + j) % 2)
                codes[i * block : (i + 1) * block, j * block : (j + 1) * block] = (
                    part / scale[i, j]
                ).to(torch.float8_e4m3fn)
        packed[name], packed[name + "_scale_inv"] = codes, scale
        expanded = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
        plain[name] = codes.float() * expanded
    save_file(packed, str(quantised / "model.safetensors"))
    save_file(plain, str(reference / "model.safetensors"))
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    edit_config(quantised, lambda c: c.update(quantization_config=config))
    edit_config(quantised, lambda c: c["quantization_config"].update(weight_block_size=[block] * 2))
    return quantised, reference


def test_fp8_block_scaled_checkpoints_load_dequantised_in_the_builtin_families(
    tmp_path: Path,
) -> None:
    """Block-scaled FP8 (transformers' FineGrainedFP8: Qwen3-*-FP8): each quantised tensor is
    dequantised with its scale at load, so the runner computes what it computes on those
    values stored in float32; a scale that does not cover its tensor is refused naming it."""
    from resin.llm import LLM

    quantised, reference = fp8_quantised(REPO / "tests" / "fixtures" / "qwen3", tmp_path)
    loaded = load_builtin(quantised)
    expected = load_builtin(reference)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in loaded)
    params = resin.SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    ours = LLM(quantised).generate([[5, 6, 7, 8]], params)[0]
    assert ours.token_ids == LLM(reference).generate([[5, 6, 7, 8]], params)[0].token_ids
    name = "model.layers.0.self_attn.q_proj.weight"
    edit_tensors(quantised, lambda t: t.update({name + "_scale_inv": t[name + "_scale_inv"][:1]}))
    with pytest.raises(WeightsError, match="q_proj"):
        load_builtin(quantised)


# -- 5: model-directory shapes follow the config -----------------------------------------------


def _text(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config", config)


@pytest.mark.parametrize(
    "case,error",
    [
        (
            "q_proj_rows",
            rf"{Q_PROJ} has shape \(62, 80\).*\(64, 80\).*num_attention_heads\*head_dim",
        ),
        (
            "kv_heads_3",
            r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)",
        ),
        ("head_dim_8", r"has shape \(16,\).*implies \(8,\) \(from config fields \(head_dim\)\)"),
        ("vocab_512", r"embed_tokens\.weight has shape \(384, 80\).*implies \(512, 80\)"),
        ("intermediate_64", r"mlp\.\w+_proj\.weight has shape .*intermediate_size"),
    ],
)
def test_model_directory_shapes_must_follow_the_config(
    tmp_path: Path, case: str, error: str
) -> None:
    ckpt = copy_of(GEMMA3 / "tiny", tmp_path)
    if case == "q_proj_rows":
        edit_tensors(ckpt, lambda t: t.update({Q_PROJ: t[Q_PROJ][:-2].contiguous()}))
    else:
        field, value = {
            "kv_heads_3": ("num_key_value_heads", 3),
            "head_dim_8": ("head_dim", 8),
            "vocab_512": ("vocab_size", 512),
            "intermediate_64": ("intermediate_size", 64),
        }[case]
        edit_config(ckpt, lambda c: _text(c).update({field: value}))
    with pytest.raises((WeightsError, ConfigError), match=error):
        load_model_dir(ckpt)


# -- 6-10: config.json and generation_config.json ----------------------------------------------


def _mixtral(**changes: Any) -> dict[str, Any]:
    return {**json.loads((MIXTRAL / "config.json").read_text()), **changes}


def test_mixtral_with_more_experts_per_token_than_experts_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(8\) exceeds num_local_experts"):
        load_model_config(_mixtral(num_experts_per_tok=8))
    with pytest.raises(ConfigError, match=r"'num_local_experts' must be positive"):
        load_model_config(_mixtral(num_local_experts=0))


@pytest.mark.parametrize(
    "rope,error",
    [
        ({"rope_type": "linear", "factor": 0.0}, r"linear field 'factor' must be positive"),
        (
            {
                "rope_type": "llama3",
                "factor": -2.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
            r"llama3 field 'factor' must be positive",
        ),
        ({"rope_type": "yarn", "factor": 0.0}, r"yarn field 'factor' must be positive"),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0},
            r"'low_freq_factor' and 'high_freq_factor' are both 2\.0",
        ),
    ],
)
def test_bad_rope_scaling_is_refused_by_field(rope: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        load_model_config(_mixtral(rope_parameters={"rope_theta": 10000.0, **rope}))


def test_architectures_and_model_type_of_two_families_are_refused(tmp_path: Path) -> None:
    ckpt = copy_of(LLAMA, tmp_path)
    edit_config(ckpt, lambda c: c.update(model_type="qwen3"))
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM but 'model_type' is 'qwen3'"):
        ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(ckpt)
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM but 'model_type' is 'qwen3'"):
        load_model_config(ckpt)
    gemma = copy_of(GEMMA3 / "tiny", tmp_path, "gemma")
    edit_config(gemma, lambda c: c.update(model_type="llama"))
    with pytest.raises(ConfigError, match=r"Gemma3ForCausalLM but 'model_type' is 'llama'"):
        ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(gemma)
    # Only one of the two (the registry needs model_type): resolves by it, as before.
    edit_config(ckpt, lambda c: c.pop("architectures"))
    assert ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(ckpt).name == "torch"
    assert load_model_config(ckpt).architecture == "Qwen3ForCausalLM"
    # A model_type no registered family has (a wrapper's own) is not a disagreement.
    edit_config(ckpt, lambda c: c.update(architectures=["LlamaForCausalLM"], model_type="x"))
    assert ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(ckpt).name == "torch"
    assert load_model_config(ckpt).architecture == "LlamaForCausalLM"


@pytest.mark.parametrize("field", ["dtype", "torch_dtype"])
def test_unknown_dtype_name_is_refused(tmp_path: Path, field: str) -> None:
    ckpt = copy_of(LLAMA, tmp_path)
    edit_config(ckpt, lambda c: c.update({"dtype": None, field: "float42"}))
    with pytest.raises(ConfigError, match=rf"field '{field}' is 'float42', not a dtype name"):
        load_model_config(ckpt)
    with pytest.raises(ConfigError, match=rf"config\.json: field '{field}' is 'float42'"):
        ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(ckpt)


@pytest.mark.parametrize(
    "fields,error",
    [
        ({"temperature": "hot"}, r"field 'temperature' must be a number, got 'hot'"),
        ({"top_k": "5"}, r"field 'top_k' must be an int, got '5'"),
        ({"max_new_tokens": 2.5}, r"field 'max_new_tokens' must be an int"),
        ({"top_p": 5.0}, r"field 'top_p' is 5\.0, which sampling refuses"),
        ({"eos_token_id": "1"}, r"field 'eos_token_id' must be a token id"),
    ],
)
def test_generation_config_fields_are_checked_at_load(
    tmp_path: Path, fields: dict[str, Any], error: str
) -> None:
    ckpt = copy_of(LLAMA, tmp_path)
    (ckpt / "generation_config.json").write_text(json.dumps(fields))
    with pytest.raises(ConfigError, match=rf"generation_config\.json: {error}"):
        check_generation_config(ckpt)


def test_generation_config_nulls_mean_unset(tmp_path: Path) -> None:
    from resin.registry import resolve_runner

    ckpt = copy_of(LLAMA, tmp_path)
    (ckpt / "generation_config.json").write_text(
        json.dumps({"temperature": None, "top_k": None, "eos_token_id": [2, 0]})
    )
    check_generation_config(ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ConfigError, match=r"'temperature' must be a number"):
        resolve_runner(ckpt, registry=ModelRegistry(use_cwd=False, use_env=False))


def test_dynamic_rope_serves_inside_its_pretrained_length_and_refuses_past_it(
    tmp_path: Path,
) -> None:
    """A dynamic-NTK checkpoint generates what the same weights with the default rope do
    (transformers' dynamic rope inside ``max_position_embeddings``); a ``max_model_len`` past
    it is refused at load, naming both lengths."""
    from resin import LLM, SamplingParams
    from resin.loading import ConfigError

    dynamic = copy_of(LLAMA, tmp_path)
    edit_config(
        dynamic,
        lambda c: c.update(
            rope_parameters={"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 4.0}
        ),
    )
    params = SamplingParams(max_tokens=6, temperature=0.0)
    want = LLM(LLAMA, max_model_len=64).generate([[5, 9, 17, 3]], params)[0].token_ids
    assert LLM(dynamic, max_model_len=64).generate([[5, 9, 17, 3]], params)[0].token_ids == want
    with pytest.raises(ConfigError, match="max_model_len 1024 is past max_position_embeddings 512"):
        LLM(dynamic, max_model_len=1024)


def test_transformers_weights_names_the_file_loaded(tmp_path: Path) -> None:
    """config.json's ``transformers_weights`` names the weights file transformers loads, ahead
    of ``model.safetensors``: Resin loads the same one (it loaded model.safetensors, and refused
    a checkpoint holding only the named file)."""
    ckpt = copy_of(LLAMA, tmp_path)
    (ckpt / "model.safetensors").rename(ckpt / "alt.safetensors")
    config = load_model_config(ckpt)
    edit_config(ckpt, lambda c: c.update(transformers_weights="alt.safetensors"))
    named = load_weights(ckpt, config)
    # A stale default-named file beside it is not what transformers loads.
    stale = {k: v * 2 for k, v in load_file(str(ckpt / "alt.safetensors")).items()}
    save_file(stale, str(ckpt / "model.safetensors"))
    loaded = load_weights(ckpt, config)
    assert all(torch.equal(loaded[k], named[k]) for k in named)
    assert not torch.equal(loaded[Q_PROJ], stale[Q_PROJ])
    # A registry entry point (the model-directory loader shares locate_tensors).
    assert ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(ckpt).name == "torch"


@pytest.mark.parametrize(
    "name, message",
    [
        ("gone.safetensors", "names gone.safetensors, which is missing"),
        ("../llama/model.safetensors", "inside the checkpoint directory"),
        ("weights.bin", "must name a .safetensors file"),
        (3, "must name a .safetensors file"),
    ],
)
def test_transformers_weights_refused_when_unusable(
    tmp_path: Path, name: Any, message: str
) -> None:
    ckpt = copy_of(LLAMA, tmp_path)
    edit_config(ckpt, lambda c: c.update(transformers_weights=name))
    with pytest.raises(WeightsError, match=message):
        load_weights(ckpt, load_model_config(ckpt))


@pytest.mark.parametrize("model", ["gemma3", "glm5_flash"])
def test_model_directory_refuses_bidirectional_attention(tmp_path: Path, model: str) -> None:
    """``is_causal: false`` makes transformers build a bidirectional mask for any decoder
    (masking_utils.create_causal_mask); a model directory refuses it when the runner is built,
    as the built-in families do at parse (test_loading_config), naming the field."""
    ckpt = copy_of(REPO / "resin" / "models" / model / "tiny", tmp_path)
    edit_config(ckpt, lambda c: c.update(is_causal=False))
    entry = ModelRegistry(use_cwd=False, use_env=False).for_checkpoint(ckpt)
    with pytest.raises(ConfigError, match=f"{model}: config.json: is_causal false"):
        entry.load_runner(ckpt)
