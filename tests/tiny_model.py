"""Build a tiny random-weight Llama model + tokenizer for vLLM tests.

Nothing is downloaded: the weights come from a fixed seed and the tokenizer is a
small word-level/BPE tokenizer trained on a fixed corpus with the `tokenizers`
library.  The directory loads with ``AutoTokenizer``/``AutoModelForCausalLM``
and with vLLM (``LLM(model=path, dtype="float32", enforce_eager=True)``).

``initializer_range=1.0`` gives peaked (non-flat) logits so that greedy decoding
is deterministic and comparisons between runs are exact in float32.
"""

from __future__ import annotations

import os
from pathlib import Path

VOCAB_SIZE = 512
HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
MAX_POSITIONS = 4096
SEED = 1234

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "call the calculator api with two numbers and add them",
    "search the web for the weather in paris today",
    "the answer is forty two and the question is unknown",
    "augmented language models pause to call tools and then continue",
    "memory time ranking schedules waiting requests by predicted cost",
    "preserve discard swap are three strategies for the kv cache",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
]


def _build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(str(path))


def build_tiny_model(path: str | os.PathLike) -> Path:
    """Create (or reuse) a tiny Llama model directory at ``path`` and return it.

    Deterministic: the same seed always gives the same weights and tokenizer.
    Idempotent: if ``path/config.json`` and the weights already exist, nothing
    is rebuilt.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists() and (path / "model.safetensors").exists() \
            and (path / "tokenizer.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=4 * HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=1.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    _build_tokenizer(path)
    return path


if __name__ == "__main__":  # pragma: no cover
    import sys

    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny_llama"))
