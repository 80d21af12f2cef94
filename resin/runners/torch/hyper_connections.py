"""Hyper-connections (mHC), shared by the models that use them (DeepSeek-V4, GLM-5.3-Flash).

The residual stream is ``hc_mult`` streams ``[T, hc, D]``: :func:`expand_streams` copies the
embedding into them before the first layer; around each sub-layer :func:`hyper_connection`
computes, from the streams, the ``pre`` weights that collapse them into the sub-layer's input,
the ``post`` weights and the Sinkhorn-normalised ``comb`` mixing matrix, and
:func:`mix_streams` writes ``post (x) out + comb^T @ streams`` back. The models' HF-named blocks
delegate here (their weights: ``fn`` [(2 + hc) hc, hc D], ``base``, ``scale`` [3]). Imports torch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

Weights = dict[str, torch.Tensor]


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight, the statistic in fp32, in ``x``'s dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def expand_streams(hidden: torch.Tensor, config: Any) -> torch.Tensor:
    """The embedding ``[T, D]`` copied into ``config.hc_mult`` streams ``[T, hc, D]``."""
    n = int(config.hc_mult)
    return hidden.unsqueeze(1).expand(-1, n, -1).contiguous()


def hyper_connection(
    x: torch.Tensor, w: Weights, config: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Streams ``[T, hc, D]`` -> (post ``[T, hc]`` fp32, comb ``[T, hc, hc]`` fp32, collapsed
    ``[T, D]`` = sum_j pre_j x_j in the streams' dtype). ``comb`` is a softmax then Sinkhorn:
    columns first, then ``hc_sinkhorn_iters - 1`` rounds of (rows, columns)."""
    n, eps = int(config.hc_mult), float(config.hc_eps)
    flat = unweighted_rms_norm(x.reshape(x.shape[0], -1).float(), float(config.rms_norm_eps))
    mixes = F.linear(flat, w["fn"].float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = w["base"].split([n, n, n * n])
    pre_s, post_s, comb_s = w["scale"].unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(int(config.hc_sinkhorn_iters) - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
    return post, comb, collapsed


def mix_streams(
    post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor
) -> torch.Tensor:
    """``post (x) out + comb^T @ streams``: the sub-layer's output ``out`` [T, D] written back
    into the streams [T, hc, D], in the streams' dtype."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )
