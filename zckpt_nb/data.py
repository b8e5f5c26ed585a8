"""The shipped corpus, the byte-level BPE tokenizer trained on it at run time, and deterministic batches: each step's
global batch is a pure function of (seed, step), whatever the world size; rank r takes a contiguous slice."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"


def corpus_text() -> str:
    """The small English corpus shipped with the package (original text, CC0; see data/LICENSE)."""
    return files("zckpt_nb").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def train_tokenizer(vocab_size: int) -> Any:
    """Train a byte-level BPE tokenizer on the corpus and wrap it for `save_pretrained`."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus_text().split("\n\n"), vocab_size=vocab_size,
                            special_tokens=[EOS], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOS, eos_token=EOS,
                                   pad_token=EOS, model_max_length=1_000_000)


def load_or_train_tokenizer(output_dir: str | Path, vocab_size: int) -> Any:
    """The tokenizer saved beside a checkpoint (on resume), else a fresh one."""
    from transformers import AutoTokenizer

    if (Path(output_dir) / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(output_dir))
    return train_tokenizer(vocab_size)


def encode_corpus(tokenizer: Any) -> Any:
    """The whole corpus as one 1-D LongTensor of token ids, paragraphs separated by EOS."""
    import torch

    ids: list[int] = []
    for paragraph in corpus_text().split("\n\n"):
        ids += tokenizer(paragraph.strip())["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def global_batch_for_step(tokens: Any, *, step: int, seed: int, global_batch: int, seq_len: int) -> Any:
    """Random windows of the corpus for optimizer step `step`: the same call always gives the same batch."""
    import torch

    g = torch.Generator().manual_seed((seed * 1_000_003) + step)
    starts = torch.randint(0, len(tokens) - seq_len, (global_batch,), generator=g)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


def rank_share(global_batch: int, world_size: int, rank: int) -> range:
    """Indices of the global batch that rank `rank` trains on: contiguous, sizes differ by at most one."""
    return micro_steps(range(global_batch), world_size)[rank]


def micro_steps(share: range, steps: int) -> list[range]:
    """Split a rank's share into `steps` micro-batches of near-equal size (some may be empty)."""
    base, extra = divmod(len(share), steps)
    bounds = [share.start + i * base + min(i, extra) for i in range(steps + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]
