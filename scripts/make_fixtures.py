"""Write tiny random-weight checkpoints and their HF goldens into ``tests/fixtures/<name>/``.

Dev-only (needs ``torch`` and ``transformers``); the output is committed, so tests never need
to run this. For each supported architecture (llama, mistral, qwen2, qwen3, qwen3_moe, mixtral)
it writes:

- ``config.json`` + ``model.safetensors`` (fp32, a few hundred thousand parameters), saved with
  ``save_pretrained`` so tensor names are the checkpoint names HF uses;
- ``generation_config.json`` (BOS, EOS ids ``[<|eos|>, <|im_end|>]``, pad);
- ``tokenizer.json`` + ``tokenizer_config.json``: a byte-level BPE (vocab 384) trained here with
  the ``tokenizers`` library on a fixed corpus, special tokens ``<|bos|>``, ``<|eos|>``,
  ``<|im_start|>``, ``<|im_end|>``, a post-processor that prepends ``<|bos|>``, and a ChatML
  chat template;
- ``goldens.json``: for prompts of 1 to 200 tokens, HF's greedy continuation
  (``generate(do_sample=False, max_new_tokens=16)``, stopping at the generation config's EOS
  ids, EOS included when produced), the top-5 logprobs of the raw logits at every generated
  position, and ``min_top2_gap``: the smallest top-1 minus top-2 logit gap over those positions
  (how far the goldens are from a tie).

Weights are re-initialised with scales chosen so logits spread over several units (projections
``N(0, 1/fan_in)``, embeddings ``N(0, 1)``, lm_head ``N(0, 256/hidden)``, norm weights in
[0.5, 1.5]), so greedy tokens are not decided by near ties. Everything is seeded; running the
script twice writes identical files.

Usage: ``python scripts/make_fixtures.py [--out tests/fixtures] [--only llama,qwen3]``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3
VOCAB_SIZE = 384
MAX_NEW_TOKENS = 16
TOP_LOGPROBS = 5
PROMPT_LENGTHS = (1, 2, 7, 16, 33, 64, 100, 200)
TEXT_PROMPTS = ("def main():", "Hello, world! The quick brown fox")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = """\
def main():
    print("hello, world")
    for i in range(10):
        if i % 2 == 0:
            continue
        total = total + i * 3
    return total

class Engine:
    def __init__(self, config):
        self.config = config
        self.requests = []

    def step(self):
        plan = self.schedule()
        return self.runner.forward(plan)

The quick brown fox jumps over the lazy dog. A model reads tokens and writes tokens;
the engine schedules requests, pages the cache and samples the next token for each row.
Hello, world! How are you today? I am fine, thank you. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100.
import numpy as np
x = np.zeros((4, 8), dtype=np.float32)
while True:
    break
"""

# Per fixture: (architecture, config class kwargs). Shared dims: hidden 64, 4 heads of 16,
# 2 KV heads (GQA), 3 or 4 layers, vocab 384, 512 positions.
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=EOS_ID,
    tie_word_embeddings=False,
)
FIXTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", dict(rope_theta=10000.0, num_hidden_layers=4)),
    "mistral": ("MistralForCausalLM", dict(rope_theta=10000.0, sliding_window=32, head_dim=16)),
    "qwen2": (
        "Qwen2ForCausalLM",
        dict(rope_theta=1e6, use_sliding_window=False, tie_word_embeddings=True),
    ),
    "qwen3": ("Qwen3ForCausalLM", dict(rope_theta=1e6, head_dim=16, use_sliding_window=False)),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        dict(
            rope_theta=1e6,
            head_dim=16,
            use_sliding_window=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
        ),
    ),
    "mixtral": (
        "MixtralForCausalLM",
        dict(
            rope_theta=1e6,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=48,
            sliding_window=None,
        ),
    ),
}


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE trained on CORPUS; special tokens take ids 0-3; BOS is prepended."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS] * 4, trainer=trainer)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|bos|> $A",
                pair="<|bos|> $A <|bos|> $B",
                special_tokens=[("<|bos|>", BOS_ID)],
            ),
        ]
    )
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    return tokenizer


def tokenizer_config() -> dict[str, Any]:
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|eos|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHATML_TEMPLATE,
    }


@torch.no_grad()
def reinit_weights(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded values at scales that keep logits apart."""
    gen = torch.Generator().manual_seed(seed)
    hidden = int(model.config.hidden_size)  # type: ignore[union-attr,arg-type]
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            values = 0.5 + torch.rand(param.shape, generator=gen)
        elif "embed_tokens" in name:
            values = torch.randn(param.shape, generator=gen)
        elif name.startswith("lm_head"):
            values = torch.randn(param.shape, generator=gen) * (16.0 / math.sqrt(hidden))
        elif name.endswith("bias"):
            values = torch.randn(param.shape, generator=gen) * 0.1
        else:  # projections (2-D, or fused 3-D experts): fan_in is the last dim
            values = torch.randn(param.shape, generator=gen) / math.sqrt(int(param.shape[-1]))
        param.copy_(values.to(param.dtype))


def make_prompts(tokenizer: Tokenizer, seed: int) -> list[dict[str, Any]]:
    """Text prompts (encoded with BOS) and random-id prompts of PROMPT_LENGTHS tokens."""
    gen = torch.Generator().manual_seed(seed)
    prompts: list[dict[str, Any]] = [
        {"text": text, "prompt_token_ids": tokenizer.encode(text).ids} for text in TEXT_PROMPTS
    ]
    for length in PROMPT_LENGTHS:
        body = torch.randint(len(SPECIAL_TOKENS), VOCAB_SIZE, (length - 1,), generator=gen)
        prompts.append({"text": None, "prompt_token_ids": [BOS_ID] + body.tolist()})
    return prompts


@torch.no_grad()
def hf_goldens(model: Any, prompt_ids: list[int]) -> dict[str, Any]:
    """Greedy continuation, top-5 logprobs and min top-1/top-2 logit gap for one prompt."""
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
        output_logits=True,
        return_dict_in_generate=True,
    )
    generated = out.sequences[0, len(prompt_ids) :].tolist()
    top_logprobs, gaps = [], []
    for step, logits in enumerate(out.logits[: len(generated)]):
        logits = logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        values, ids = torch.topk(logprobs, TOP_LOGPROBS)
        assert ids[0].item() == generated[step], "greedy token is not the argmax of the logits"
        top_logprobs.append({str(i): round(v, 6) for i, v in zip(ids.tolist(), values.tolist())})
        top2 = torch.topk(logits, 2).values
        gaps.append(float(top2[0] - top2[1]))
    finish = "stop" if generated and generated[-1] in (EOS_ID, IM_END_ID) else "length"
    return {
        "token_ids": generated,
        "finish_reason": finish,
        "top_logprobs": top_logprobs,
        "min_top2_gap": round(min(gaps), 6),
    }


def write_fixture(
    name: str, arch: str, overrides: dict[str, Any], tokenizer: Tokenizer, out_dir: Path, seed: int
) -> None:
    target = out_dir / name
    target.mkdir(parents=True, exist_ok=True)
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(**{**COMMON, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    model.config._attn_implementation = "eager"
    reinit_weights(model, seed)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=EOS_ID
    )
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    cases = []
    for prompt in make_prompts(tokenizer, seed):
        cases.append({**prompt, **hf_goldens(model, prompt["prompt_token_ids"])})
    goldens = {
        "architecture": arch,
        "transformers_version": transformers.__version__,
        "dtype": "float32",
        "max_new_tokens": MAX_NEW_TOKENS,
        "eos_token_ids": [EOS_ID, IM_END_ID],
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "prompts": cases,
    }
    (target / "goldens.json").write_text(json.dumps(goldens, indent=1) + "\n")
    size = sum(f.stat().st_size for f in target.iterdir())
    gaps = [c["min_top2_gap"] for c in cases]
    print(
        f"{name}: {goldens['num_parameters']} params, {size / 1e6:.2f} MB, "
        f"min top-2 gap {min(gaps):.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests" / "fixtures"
    )
    parser.add_argument("--only", default="", help="comma-separated fixture names")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    tokenizer = train_tokenizer()
    names = [n for n in FIXTURES if not args.only or n in args.only.split(",")]
    for name in names:
        arch, overrides = FIXTURES[name]
        write_fixture(
            name, arch, overrides, tokenizer, args.out, seed=1234 + list(FIXTURES).index(name)
        )


if __name__ == "__main__":
    main()
