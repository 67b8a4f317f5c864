"""`marsched model`: a random-weight Llama and a locally trained tokenizer, nothing downloaded.

The directory loads with vLLM (`LLM(model=DIR)`, `AsyncEngineArgs(model=DIR)`) and with
transformers' `AutoModelForCausalLM` / `AutoTokenizer`. Weights are random (seeded): the
model's *text* is meaningless, but its forward pass costs what a trained model of the same
shape costs, which is all a scheduling benchmark needs (the benchmark fixes every segment's
length, so the tokens sampled do not matter).

Default shape, a "small" model measured on a 2-core CPU with vLLM 0.32 (the CPU build): 4
layers, hidden 512, 8 query / 2 KV heads, MLP 2048, vocabulary 32,000 (48M parameters, 2
KiB of bf16 KV cache per token). On a 2-core CPU its steps are about 70% compute at batch 1
(2.6 ms per decode step, 26 ms for a 512-token prefill), and a decode step pays about 0.14 µs
per context token it reads, so prefill, decode batch size and context length all show up in
iteration time. The tests' tiny model (2 layers, hidden 128) is framework overhead except at
large batch × context; the "large" one (8 layers, hidden 1024) is 4 times slower per step.

Weights are saved in bfloat16, which vLLM then runs in (`dtype="auto"`): the CPU build runs
bf16 through oneDNN kernels on AVX-512 BF16 / AMX hardware, and KV cache per token is half of
float32's, so a given `VLLM_CPU_KVCACHE_SPACE` holds twice the tokens. `--dtype float32`
gives a model for exact greedy comparisons (as the tests' tiny model).

`read_model` reads back what the bench and calibration need from any Llama-like model
directory's config.json (`ModelInfo`); a built shape and a read model share one KV size
formula (`kv_bytes_per_token`).

This module imports torch, transformers and tokenizers only inside `build_model`, so that
`marsched.cli` imports without them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3: unk, bos, eos, pad
# The tokenizer's chat template: roles, the offered tools' names, assistant tool calls in the
# pythonic form that vLLM's `pythonic` tool parser reads (`[name(key="value")]`), and tool results.
# Without one, vLLM refuses every chat completion on the model.
CHAT_TEMPLATE = (
    "{%- if tools %}<tools>{% for t in tools %} {{ t.function.name if t.function is defined else t.name }}"
    "{% endfor %}{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<assistant> ["
    "{%- for c in m.tool_calls %}{{ c.function.name }}("
    "{%- if c.function.arguments is mapping %}{% for k, v in c.function.arguments.items() %}"
    "{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}"
    "{%- else %}{{ c.function.arguments }}{% endif %}){% if not loop.last %}, {% endif %}{% endfor %}]"
    "{%- elif m.role == 'tool' %}<tool> {{ m.content }}"
    "{%- else %}<{{ m.role }}> {{ m.content if m.content is string else '' }}{% endif %}{{ '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<assistant> {% endif %}"
)
MIN_VOCAB = 512  # the byte-level alphabet (256) and the specials, with room for merges
DTYPES = ("bfloat16", "float32")


class ModelDirError(ValueError):
    """The output directory cannot be used; the message names the flag that fixes it."""


def dtype_bytes(dtype: str) -> int:
    """Bytes of one value: 4 for float32, 2 for the half types (bfloat16, float16)."""
    return 4 if dtype == "float32" else 2


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    """K and V of every layer for one token."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes(dtype)


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int = 4
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 2048
    vocab: int = 32_000
    max_position: int = 4096
    seed: int = 0
    dtype: str = "bfloat16"

    def check(self) -> None:
        """Raise ValueError naming the flag whose value cannot make a Llama."""
        for flag, value, low in (("--layers", self.layers, 1), ("--hidden", self.hidden, 8), ("--heads", self.heads, 1),
                                 ("--kv-heads", self.kv_heads, 1), ("--intermediate", self.intermediate, 1),
                                 ("--vocab", self.vocab, MIN_VOCAB), ("--max-position", self.max_position, 32),
                                 ("--seed", self.seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{flag} {value!r}: give an integer >= {low}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden}: must be a multiple of --heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads}: must be a multiple of --kv-heads ({self.kv_heads})")
        if (self.hidden // self.heads) % 2:
            raise ValueError(f"--hidden {self.hidden} / --heads {self.heads}: the head size {self.hidden // self.heads} must be even (rotary embedding)")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype}: valid: {', '.join(DTYPES)}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in the model's dtype."""
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.dtype)

    @property
    def parameters(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate + 2 * h  # attention, MLP, two norms
        return self.layers * per_layer + 2 * self.vocab * h + h  # untied embedding and head, final norm


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the bench and calibration read from a model directory (`read_model`)."""

    path: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # bfloat16 | float32 | float16
    max_position: int
    vocab: int
    name: str

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "name": self.name, "layers": self.layers, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "dtype": self.dtype, "max_position": self.max_position,
                "vocab": self.vocab, "kv_bytes_per_token": self.kv_bytes_per_token}


def read_model(path: str | os.PathLike[str]) -> ModelInfo:
    """What the bench needs from a Hugging Face model directory's config.json; ValueError naming --model."""
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--model {path}: no config.json there; build a model with `marsched model --out DIR`") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--model {path}: cannot read config.json ({error})") from None
    try:
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
        return ModelInfo(str(path), int(config["num_hidden_layers"]), int(config.get("num_key_value_heads", heads)),
                         head_dim, dtype if dtype in ("float32", "float16") else "bfloat16",
                         int(config.get("max_position_embeddings", 2048)), int(config["vocab_size"]),
                         Path(path).resolve().name)
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"--model {path}: config.json lacks a Llama-like field ({error})") from None


def check_out_dir(out: Path, force: bool) -> None:
    """A new or empty directory; a non-empty one only with --force. Raises ModelDirError."""
    if out.exists() and not out.is_dir():
        raise ModelDirError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ModelDirError(f"--out {out}: directory is not empty; pass --force to overwrite the model in it")


def build_model(out: str | os.PathLike[str], shape: ModelShape = ModelShape(), force: bool = False) -> dict:
    """Write config, weights and tokenizer to `out`; return what was written (also `marsched_model.json`).

    The same shape and seed give the same weights and tokenizer.
    """
    shape.check()
    out = Path(out)
    check_out_dir(out, force)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()

    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_position,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype=shape.dtype,
    )
    torch.manual_seed(shape.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, shape.dtype)).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer_vocab = _build_tokenizer(out, shape)
    info = {"marsched_model": 1, **asdict(shape), "parameters": shape.parameters,
            "kv_bytes_per_token": shape.kv_bytes_per_token, "tokenizer_vocab": tokenizer_vocab,
            "weights": "random (torch.manual_seed(seed), transformers' default init)"}
    (out / "marsched_model.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _corpus(seed: int, lines: int) -> list[str]:
    """Pseudo-words over a skewed alphabet: enough distinct pairs for BPE to reach a large vocabulary."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz0123456789"))
    weights = np.linspace(2.0, 0.2, letters.size)
    chars = letters[rng.choice(letters.size, size=lines * 80, p=weights / weights.sum())]
    text = "".join(chars)
    cuts = np.cumsum(rng.integers(2, 11, size=lines * 12))
    words = [text[a:b] for a, b in zip(np.concatenate(([0], cuts[:-1])), cuts) if b <= len(text)]
    return [" ".join(words[i:i + 12]) for i in range(0, len(words), 12)]


def _build_tokenizer(out: Path, shape: ModelShape) -> int:
    """A byte-level BPE trained on a seeded synthetic corpus to the model's vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=shape.vocab, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_corpus(shape.seed, max(2000, shape.vocab // 2)), trainer=trainer)
    missing = shape.vocab - tokenizer.get_vocab_size()
    if missing > 0:  # the corpus ran out of merges: fill so that every id the model samples decodes
        tokenizer.add_special_tokens([f"<extra_{i}>" for i in range(missing)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.model_max_length = shape.max_position
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return len(fast)
