"""A tiny, seeded, randomly initialised Llama that the real vLLM CPU server can serve.

Why: the end-to-end suite and the fidelity harness need a *real* vLLM engine,
but nothing can be downloaded here (no hub access). A 2-layer, 128-wide Llama
built locally is about 1.6 MB, loads in seconds and decodes fast enough on
one pinned core, while vLLM runs its full scheduler, paged KV cache, prefix
cache and preemption path over it; those are what the project measures, not
the text the model writes.

A WordLevel tokenizer (``<unk>``, ``<s>``, ``</s>``, then ``t3`` .. ``t2047``
split on whitespace) is saved alongside, so text prompts, chat and
``/tokenize`` work too, and token id ``i >= 3`` round-trips as the word
``t{i}``. The weights are seeded: the same seed gives the same files.

Usage: ``python -P -m misat_bench.tiny_model OUTDIR [--seed N]``. ``-P`` keeps
the working directory off ``sys.path``: run from the repository root, the
``operator/`` folder would otherwise shadow the standard library's module.

transformers, tokenizers and torch are imported inside the builders: they come
with the ``e2e`` extra only, and importing this module must stay cheap.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB_SIZE: int = 2048
"""Vocabulary size; small so the embedding and LM head stay tiny."""
NUM_SPECIAL_TOKENS: int = 3
"""Ids 0..2 are ``<unk>``, ``<s>``, ``</s>``; traces draw prompt ids from 3 up."""
UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<unk>", "<s>", "</s>"
MAX_POSITION_EMBEDDINGS: int = 4096
"""Upper bound for ``--max-model-len``."""
DEFAULT_SEED: int = 1234
CHAT_TEMPLATE: str = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }} {{ message['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
)
"""Trivial template: roles and contents joined by spaces. Role names are not in
the vocabulary, so they become ``<unk>``; only the shape matters here."""


def vocabulary() -> dict[str, int]:
    """Word -> id map: the three special tokens, then ``t3`` .. ``t2047``."""
    vocab = {UNK_TOKEN: 0, BOS_TOKEN: 1, EOS_TOKEN: 2}
    vocab.update({f"t{i}": i for i in range(NUM_SPECIAL_TOKENS, VOCAB_SIZE)})
    return vocab


def ids_to_text(ids: list[int]) -> str:
    """Text that the saved tokenizer encodes back to exactly ``ids`` (all >= 3)."""
    if any(i < NUM_SPECIAL_TOKENS or i >= VOCAB_SIZE for i in ids):
        raise ValueError(f"ids must lie in [{NUM_SPECIAL_TOKENS}, {VOCAB_SIZE})")
    return " ".join(f"t{i}" for i in ids)


def build_tokenizer(outdir: Path) -> None:
    """Save a WordLevel fast tokenizer plus its chat template into ``outdir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Join words with spaces when decoding, so generated text reads "t5 t17 ...".
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token=UNK_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(outdir))


def build_model(outdir: Path, seed: int = DEFAULT_SEED) -> None:
    """Save a seeded random bf16 Llama (config, safetensors weights) into ``outdir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(str(outdir), safe_serialization=True)


def build(outdir: Path, seed: int = DEFAULT_SEED) -> Path:
    """Build model and tokenizer into ``outdir`` (created if needed); return it."""
    outdir.mkdir(parents=True, exist_ok=True)
    build_model(outdir, seed)
    build_tokenizer(outdir)
    (outdir / "misat-tiny-model.json").write_text(json.dumps({"seed": seed, "vocab_size": VOCAB_SIZE}, indent=2) + "\n")
    return outdir


def main(argv: list[str] | None = None) -> int:
    """CLI entry: ``python -P -m misat_bench.tiny_model OUTDIR [--seed N]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    print(build(args.outdir, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
