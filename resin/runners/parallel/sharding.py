"""Tensor-parallel sharding of the built-in (Llama-family) models: which slice of each tensor a
rank holds, and a loader that reads only that slice from the safetensors files.

Owns :class:`TensorParallelShard` (one rank's share of heads, KV heads, MLP width and vocab)
and :func:`load_weight_shard`. The split is Megatron's, as vLLM and SGLang do it:

- attention: ``q_proj`` (and its bias) by query heads — rank r holds heads ``[r·H/N, (r+1)·H/N)``;
  ``k_proj`` / ``v_proj`` by KV heads, or, with fewer KV heads than ranks, the one KV head the
  rank's query heads read (replicated over the N/KV ranks that share it); ``o_proj`` by its
  input columns (the same heads) — a row-parallel projection whose partial sums are all-reduced
  after the block; ``q_norm`` / ``k_norm`` (per head_dim) replicated;
- MLP and every MoE expert: ``gate_proj`` / ``up_proj`` by output rows, ``down_proj`` by input
  columns (all-reduced after the block); the router replicated;
- ``embed_tokens`` and ``lm_head``: by vocabulary rows, ``ceil(V / N)`` per rank (the last one
  shorter): a vocab-parallel embedding (each rank looks up its own ids, all-reduce) and
  lm_head (all-gather of the logit shards);
- norms replicated.

With expert parallelism (``expert_parallel``) the routed experts are not sliced but dealt
out whole, ``E / N`` per rank, and attention and dense MLPs are either tensor-parallel too or
replicated (``tensor_parallel`` off: EP alone). So each rank's resident bytes are ~1/N of the model (plus the replicated norms and routers)
and its KV cache holds only its KV heads (``cache_spec`` is per rank). Tensors are read with
``safe_open(...).get_slice``: a rank never materialises another rank's part. Imports torch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from resin.loading import ModelConfig
from resin.loading.quantized_weights import checkpoint_plan, read_dequantized
from resin.loading.weights import (
    WeightsError,
    expected_tensor_shapes,
    locate_tensors,
)

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class TensorParallelShard:
    """Rank ``rank`` of ``world_size`` for one checkpoint's config (see the module doc).

    ``tensor_parallel``: attention, dense MLPs and the vocabulary are split over the ranks
    (else replicated). ``expert_parallel``: each rank holds ``num_experts / world_size`` whole
    experts — ``[r·E/N, (r+1)·E/N)`` — instead of a slice of every expert; the others are
    zero-width placeholders (no bytes, no FLOPs), so the MoE block runs unchanged and its
    partial sums are all-reduced like a row-parallel MLP's."""

    rank: int
    world_size: int
    num_heads: int  # the model's query heads
    num_kv_heads: int
    vocab_size: int
    tensor_parallel: bool = True
    expert_parallel: bool = False
    num_experts: int = 0

    @classmethod
    def of_counts(
        cls, rank: int, world_size: int, num_heads: int, num_kv_heads: int, vocab_size: int
    ) -> TensorParallelShard:
        """Tensor parallelism over a model directory's checkpoint (its config's counts)."""
        if num_heads % world_size or (num_kv_heads % world_size and world_size % num_kv_heads):
            raise ValueError(
                f"tensor parallel size {world_size}: the checkpoint's {num_heads} attention "
                f"heads must split evenly, and its {num_kv_heads} KV heads split or replicate"
            )
        return cls(rank, world_size, num_heads, num_kv_heads, vocab_size)

    @classmethod
    def of(
        cls,
        config: ModelConfig,
        rank: int,
        world_size: int,
        *,
        tensor_parallel: bool = True,
        expert_parallel: bool = False,
    ) -> TensorParallelShard:
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        n = world_size
        if not (tensor_parallel or expert_parallel):
            raise ValueError("a parallel runner splits attention (TP), experts (EP) or both")
        if expert_parallel:
            if config.moe is None:
                raise ValueError("expert parallelism needs a MoE checkpoint; this one is dense")
            if config.moe.num_experts % n:
                raise ValueError(
                    f"expert parallel size {n} does not divide the {config.moe.num_experts} "
                    "experts of this checkpoint"
                )
        if tensor_parallel:
            if heads % n:
                raise ValueError(
                    f"tensor parallel size {n} does not divide the {heads} attention heads of "
                    "this checkpoint"
                )
            if kv % n and n % kv:
                raise ValueError(
                    f"tensor parallel size {n} and the checkpoint's {kv} KV heads: one must "
                    "divide the other (KV heads are split, or replicated over ranks)"
                )
            widths = [config.intermediate_size]
            if config.moe is not None and not expert_parallel:
                widths.append(config.moe.moe_intermediate_size)
            if any(w % n for w in widths):
                raise ValueError(
                    f"tensor parallel size {n} does not divide the MLP width of this checkpoint"
                )
        experts = config.moe.num_experts if config.moe is not None else 0
        return cls(rank, n, heads, kv, config.vocab_size, tensor_parallel, expert_parallel, experts)

    @property
    def tp_size(self) -> int:
        return self.world_size if self.tensor_parallel else 1

    @property
    def tp_rank(self) -> int:
        return self.rank if self.tensor_parallel else 0

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def local_kv_heads(self) -> int:
        return max(self.num_kv_heads // self.tp_size, 1)

    @property
    def first_kv_head(self) -> int:
        """The first KV head this rank holds (with replication: the one its heads read)."""
        if self.num_kv_heads >= self.tp_size:
            return self.tp_rank * self.local_kv_heads
        return self.tp_rank * self.num_kv_heads // self.tp_size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.tp_size)

    @property
    def vocab_start(self) -> int:
        return min(self.tp_rank * self.vocab_per_rank, self.vocab_size)

    @property
    def vocab_end(self) -> int:
        return min(self.vocab_start + self.vocab_per_rank, self.vocab_size)

    @property
    def local_experts(self) -> range:
        if not self.expert_parallel:
            return range(self.num_experts)
        per_rank = self.num_experts // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def slices(self, name: str, shape: tuple[int, ...], head_dim: int) -> tuple[slice, ...]:
        """This rank's part of checkpoint tensor ``name`` (full ``shape``), per dimension
        (an empty slice: a placeholder of no width)."""
        full = tuple(slice(0, n) for n in shape)

        def rows(start: int, stop: int) -> tuple[slice, ...]:
            return (slice(start, stop), *full[1:])

        def cols(start: int, stop: int) -> tuple[slice, ...]:
            return (full[0], slice(start, stop), *full[2:])

        expert = _EXPERT.search(name)
        up = name.endswith(("gate_proj.weight", "up_proj.weight", ".w1.weight", ".w3.weight"))
        down = name.endswith((".down_proj.weight", ".w2.weight"))
        if expert is not None and self.expert_parallel:
            if int(expert.group(1)) in self.local_experts:
                return full  # a whole local expert
            return rows(0, 0) if up else cols(0, 0)  # another rank's: no bytes here
        if not self.tensor_parallel:
            return full
        r, n = self.tp_rank, self.tp_size
        heads = self.local_heads * head_dim
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return rows(self.vocab_start, self.vocab_end)
        if ".q_proj." in name:
            return rows(r * heads, (r + 1) * heads)
        if ".k_proj." in name or ".v_proj." in name:
            first = self.first_kv_head * head_dim
            return rows(first, first + self.local_kv_heads * head_dim)
        if ".o_proj.weight" in name:
            return cols(r * heads, (r + 1) * heads)
        if up:
            return rows(r * shape[0] // n, (r + 1) * shape[0] // n)
        if down:
            return cols(r * shape[1] // n, (r + 1) * shape[1] // n)
        if name.endswith((".gate_proj.bias", ".up_proj.bias")):
            return rows(r * shape[0] // n, (r + 1) * shape[0] // n)
        return full  # norms, routers, o_proj / down_proj biases (added once: rank 0's only)

    def keeps_bias(self, name: str) -> bool:
        """A row-parallel projection's bias is added once, after the all-reduce: rank 0 keeps
        it, the others hold zeros."""
        if not self.tensor_parallel:
            return True
        return self.rank == 0 or not name.endswith((".o_proj.bias", ".down_proj.bias"))


# Rule kinds a model directory's ``weights.TENSOR_PARALLEL`` gives per tensor (its runner name
# relative to the layer, or a global name): (kind, dim).
RULE_KINDS = ("heads", "head_scalars", "kv_heads", "width", "vocab", "once")


def rule_part(
    shard: TensorParallelShard,
    rule: tuple[str, int | None],
    shape: tuple[int, ...],
    head_dim: int,
) -> tuple[tuple[slice, ...], bool]:
    """This rank's part of a tensor under one rule: ``heads`` / ``head_scalars`` — the rank's
    query heads along ``dim`` (``head_dim`` or 1 entry per head); ``kv_heads`` — its KV heads
    (replicated when fewer than ranks); ``width`` — an even split of ``dim``; ``vocab`` — its
    vocabulary rows; ``once`` — whole on rank 0, zeros elsewhere (a bias after a row-parallel
    projection). Returns (slices, zero)."""
    kind, dim = rule
    full = [slice(0, n) for n in shape]
    if kind not in RULE_KINDS:
        raise ValueError(f"tensor-parallel rule {kind!r}; known: {', '.join(RULE_KINDS)}")
    if kind == "once":
        return tuple(full), shard.rank != 0
    assert dim is not None
    r, n = shard.tp_rank, shard.tp_size
    if kind in ("heads", "head_scalars"):
        unit = head_dim if kind == "heads" else 1
        full[dim] = slice(r * shard.local_heads * unit, (r + 1) * shard.local_heads * unit)
    elif kind == "kv_heads":
        first = shard.first_kv_head * head_dim
        full[dim] = slice(first, first + shard.local_kv_heads * head_dim)
    elif kind == "width":
        if shape[dim] % n:
            raise ValueError(f"tensor-parallel size {n} does not divide a width of {shape[dim]}")
        full[dim] = slice(r * shape[dim] // n, (r + 1) * shape[dim] // n)
    else:  # vocab
        full[dim] = slice(shard.vocab_start, shard.vocab_end)
    return tuple(full), False


def load_weight_shard(
    model_dir: str | os.PathLike[str],
    config: ModelConfig,
    shard: TensorParallelShard,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """This rank's part of every tensor the built-in runner needs (checkpoint names), each read
    as a slice (never the whole tensor) and checked against the config's full shape first."""
    directory = Path(model_dir)
    files = locate_tensors(directory)
    expected = expected_tensor_shapes(config)
    if config.tie_word_embeddings and "lm_head.weight" not in files:
        del expected["lm_head.weight"]
    missing = sorted(set(expected) - set(files))
    if missing:
        raise WeightsError(f"{directory}: missing tensor(s) {', '.join(missing[:5])}")
    plan = checkpoint_plan(directory, files, is_known=expected.__contains__)
    quantised = {} if plan is None else plan.tensors  # read whole, dequantised, then sliced
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in names:
                got = tuple(handle.get_slice(name).get_shape())
                if got != expected[name]:
                    raise WeightsError(
                        f"{path.name}: tensor {name} has shape {got}, config.json implies "
                        f"{expected[name]}"
                    )
            for name in names:
                index = shard.slices(name, expected[name], config.head_dim)
                if any(part.stop == part.start for part in index):  # another rank's expert
                    size = [part.stop - part.start for part in index]
                    out[name] = torch.empty(size, device=device, dtype=dtype)
                    continue
                if name in quantised:
                    tensor = read_dequantized(quantised[name], files)[index]
                else:
                    tensor = handle.get_slice(name)[index]
                if not shard.keeps_bias(name):
                    tensor = torch.zeros_like(tensor)
                out[name] = tensor.to(device=device, dtype=dtype).contiguous()
    return out
