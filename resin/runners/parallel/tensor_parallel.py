"""A tensor-parallel rank of the built-in (Llama-family) runner: the same model definition on
this rank's weight shard, with the collectives Megatron's split needs.

Owns :func:`tensor_parallel_runner`: a :class:`~resin.runners.torch.TorchRunner` whose layers
see only their shard (the blocks read head counts and widths off the weights, so they run
unchanged) and whose hooks add the communication, each a ``torch.distributed`` collective on
the given process group (gloo on CPU, NCCL on GPUs):

- ``self_attn`` and ``mlp`` outputs: all-reduce (row-parallel ``o_proj`` / ``down_proj``;
  under expert parallelism the MoE layers' outputs, each rank's experts' share; with EP
  alone attention and dense MLPs are replicated and need none);
- the embedding: a vocab-parallel lookup — each rank embeds the ids in its vocabulary range,
  zeros elsewhere — then all-reduce;
- DP attention (``data_parallel``): attention replicated, each rank on its own requests (its
  own engine and plan), the MoE layers exchanging tokens (:func:`_data_parallel_moe`);
- the logits: each rank's vocabulary shard, padded to ``ceil(V / N)``, all-gathered and cut to
  V, so rank 0 samples from the full distribution.

The KV cache holds the rank's KV heads only: ``cache_spec`` is the per-rank bytes. Imports
torch.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from resin.loading import load_model_config
from resin.runners.parallel.sharding import TensorParallelShard, load_weight_shard
from resin.runners.torch.model_definition import ModelDefinition
from resin.runners.torch.model_weights import ModelWeights
from resin.runners.torch.runner import TorchRunner, _runner_name, llama_family_definition


def _all_reduce_after(block: Any, group: Any) -> Any:
    def reduced(x: torch.Tensor, w: dict[str, torch.Tensor], ctx: Any) -> torch.Tensor:
        out = block(x, w, ctx)
        dist.all_reduce(out, group=group)
        return out

    reduced.__name__ = f"all_reduced_{getattr(block, '__name__', 'block')}"
    return reduced


def _data_parallel_moe(block: Any, group: Any) -> Any:
    """DP attention's MoE layer: every rank's tokens through every rank's experts. The
    ranks' token counts differ (an idle rank has none): all-gather the counts, all-gather the
    tokens padded to the longest, run the local experts on all of them, all-reduce the
    partial sums (each expert is on one rank), keep this rank's rows."""

    def moe(x: torch.Tensor, w: dict[str, torch.Tensor], ctx: Any) -> torch.Tensor:
        world = dist.get_world_size(group)
        count = torch.tensor([x.shape[0]], dtype=torch.int64)
        counts = [torch.zeros_like(count) for _ in range(world)]
        dist.all_gather(counts, count, group=group)
        sizes = [int(c) for c in counts]
        longest = max(sizes)
        padded = x.new_zeros((longest, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        tokens = torch.cat([p[:n] for p, n in zip(parts, sizes)])
        # The token ids travel too: a hash-routed MoE (DeepSeek-V4) routes on them.
        ids = ctx.input_ids
        padded_ids = ids.new_zeros(longest)
        padded_ids[: ids.shape[0]] = ids
        id_parts = [torch.empty_like(padded_ids) for _ in range(world)]
        dist.all_gather(id_parts, padded_ids, group=group)
        ctx = dataclasses.replace(
            ctx, input_ids=torch.cat([p[:n] for p, n in zip(id_parts, sizes)])
        )
        out = block(tokens, w, ctx) if tokens.shape[0] else tokens.clone()
        dist.all_reduce(out, group=group)
        start = sum(sizes[: dist.get_rank(group)])
        return out[start : start + x.shape[0]]

    moe.__name__ = f"data_parallel_{getattr(block, '__name__', 'moe')}"
    return moe


def tensor_parallel_definition(
    definition: ModelDefinition,
    shard: TensorParallelShard,
    group: Any,
    moe_layers: list[bool] | None = None,
    data_parallel: bool = False,
) -> ModelDefinition:
    """``definition`` with the collectives of the module doc added around its blocks
    (``moe_layers[i]``: layer i's MLP is routed experts, all-reduced under EP)."""
    moe_layers = moe_layers or [False] * len(definition.layers)
    start, end, per_rank = shard.vocab_start, shard.vocab_end, shard.vocab_per_rank
    vocab = shard.vocab_size

    def embed(input_ids: torch.Tensor, w: dict[str, torch.Tensor], ctx: Any) -> torch.Tensor:
        local = input_ids - start
        inside = (input_ids >= start) & (input_ids < end)
        out = F.embedding(local.clamp(0, end - start - 1), w["embed_tokens.weight"])
        out = out * inside[:, None].to(out.dtype)
        dist.all_reduce(out, group=group)
        return out

    def logits(hidden: torch.Tensor, w: dict[str, torch.Tensor], ctx: Any) -> torch.Tensor:
        head = w.get("lm_head.weight", w["embed_tokens.weight"])
        local = F.linear(hidden, head)
        if local.shape[-1] < per_rank:  # the last shard: pad to the common size
            pad = local.new_full((local.shape[0], per_rank - local.shape[-1]), float("-inf"))
            local = torch.cat([local, pad], dim=-1)
        parts = [torch.empty_like(local) for _ in range(shard.world_size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)[:, :vocab]

    def reduced(name: str, index: int) -> bool:
        """Whose output is a partial sum: attention and MLPs under TP; MoE under EP."""
        if name == "self_attn":
            return shard.tensor_parallel
        if name == "mlp":
            return shard.tensor_parallel or (shard.expert_parallel and moe_layers[index])
        return False

    def wrap(name: str, index: int, fn: Any) -> Any:
        if data_parallel and name == "mlp" and moe_layers[index]:
            return _data_parallel_moe(fn, group)
        return _all_reduce_after(fn, group) if reduced(name, index) else fn

    layers = [
        dataclasses.replace(
            layer, children={name: wrap(name, i, fn) for name, fn in layer.children.items()}
        )
        for i, layer in enumerate(definition.layers)
    ]
    if not shard.tensor_parallel:  # EP alone: the embedding and lm_head are replicated
        return dataclasses.replace(definition, layers=layers)
    return dataclasses.replace(definition, layers=layers, embed=embed, logits=logits)


def tensor_parallel_runner(
    model_dir: str | os.PathLike[str],
    rank: int,
    world_size: int,
    group: Any = None,
    *,
    tensor_parallel: bool = True,
    expert_parallel: bool = False,
    data_parallel: bool = False,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    attention_backend: Any = None,
    model_directory: str | os.PathLike[str] | None = None,
    context_parallel: bool = False,
) -> Any:
    """Rank ``rank``'s runner: its weight shard (read as slices), the model with local head
    counts (its KV cache is its KV heads), the collectives on ``group``. ``expert_parallel``:
    whole experts dealt over the ranks (:class:`~.sharding.TensorParallelShard`);
    ``tensor_parallel`` off with it: attention and dense layers replicated (EP alone);
    ``data_parallel``: each rank runs its own requests' plan (DP attention) and the MoE
    layers exchange the ranks' tokens (:func:`_data_parallel_moe`)."""
    if data_parallel and (tensor_parallel or not expert_parallel):
        raise ValueError("DP attention runs with the experts dealt over the ranks (EP), no TP")
    if context_parallel:
        return _context_parallel_runner(
            model_dir, rank, world_size, group, device, dtype, attention_backend, model_directory
        )
    if model_directory is not None:  # a model directory's own sharding rules
        from resin.runners.torch.model_dir import ModelDirRunner

        return ModelDirRunner.from_model_dir(
            Path(model_directory),
            model_dir,
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
            parallel=(rank, world_size, group, tensor_parallel, expert_parallel, data_parallel),
        )
    config = load_model_config(model_dir)
    shard = TensorParallelShard.of(
        config, rank, world_size, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel
    )
    local_config = dataclasses.replace(
        config,
        num_attention_heads=shard.local_heads,
        num_key_value_heads=shard.local_kv_heads,
    )
    device = torch.device(device)
    flat = load_weight_shard(model_dir, config, shard, device=device, dtype=dtype)
    weights = ModelWeights.from_flat(flat, config.num_hidden_layers, rename=_runner_name)
    definition = tensor_parallel_definition(
        llama_family_definition(local_config, device),
        shard,
        group,
        [config.is_moe_layer(i) for i in range(config.num_hidden_layers)],
        data_parallel,
    )
    # The vocabulary the sampler sees is the whole one (the logits are all-gathered).
    definition = dataclasses.replace(definition, vocab_size=config.vocab_size)
    runner = TorchRunner(definition, weights, device, dtype, attention_backend)
    runner.model_config = config
    runner.shard = shard  # type: ignore[attr-defined]
    runner.data_parallel = data_parallel  # type: ignore[attr-defined]
    runner.moe_layer_indices = {  # type: ignore[attr-defined]
        i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)
    }
    return runner


def _context_parallel_runner(
    model_dir: str | os.PathLike[str],
    rank: int,
    world_size: int,
    group: Any,
    device: Any,
    dtype: torch.dtype,
    attention_backend: Any,
    model_directory: str | os.PathLike[str] | None = None,
) -> Any:
    """Rank ``rank`` of a context-parallel group: the whole model (a built-in family, or a
    model directory's) on this rank (:mod:`.context_parallel`)."""
    from resin.runners.parallel.context_parallel import (
        ContextParallelRunner,
        context_parallel_model_dir_runner,
    )

    runner: Any
    if model_directory is not None:
        runner = context_parallel_model_dir_runner().from_model_dir(
            Path(model_directory),
            model_dir,
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
        )
    else:  # the whole built-in model: TorchRunner's own loader
        runner = ContextParallelRunner.from_pretrained(
            model_dir, device=device, dtype=dtype, attention_backend=attention_backend
        )
    runner.cp = (rank, world_size, group)
    return runner


def resident_weight_bytes(runner: TorchRunner) -> int:
    """Bytes of every weight tensor this rank holds."""
    tensors = list(runner.weights.globals.values()) + [
        t for layer in runner.weights.layers for t in layer.values()
    ]
    return sum(t.numel() * t.element_size() for t in tensors)
