"""Text data for the demo and the GPT-2 recipes: a bundled corpus, a tokenizer, token blocks.

- `stdlib_corpus(split)`: the `.py` files of the running Python's standard library, in a
  fixed order, split into train / held-out by a hash of each file's relative path — a few
  MB of real text that every machine already has.
- `read_texts(paths)`: documents from local `.txt` (and any plain text file), `.jsonl` /
  `.json` and `.parquet` files (their `text` field).
- `train_tokenizer(texts)`: a byte-level BPE trained with `tokenizers`, cached on disk by a
  hash of its inputs, wrapped as a `PreTrainedTokenizerFast` whose bos/eos token
  `<|endoftext|>` is id 0, inside the vocabulary.
- `token_blocks(tokenizer, texts, block_size)`: the documents tokenized, each followed by
  eos, concatenated and cut into `[n, block_size]` rows.
- `tiny_gpt2(vocab_size, ...)`: a `GPT2LMHeadModel` from a `GPT2Config`; nothing is
  downloaded.

transformers, tokenizers and datasets are imported inside the functions that need them
(torch comes with the `gradientmail.integration` package), so both integrations and the
demo use it without pulling in Hugging Face until they tokenize.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradientmail.errors import ConfigError, MissingExtra

if TYPE_CHECKING:
    import torch
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

__all__ = [
    "EOS_TOKEN",
    "held_out",
    "read_budget",
    "read_texts",
    "stdlib_corpus",
    "tiny_gpt2",
    "token_blocks",
    "train_tokenizer",
]

#: The one special token of a trained tokenizer: document separator, bos and eos (id 0).
EOS_TOKEN = "<|endoftext|>"
# Bumped when train_tokenizer's recipe changes, so an old cache entry is never reused.
_TOKENIZER_RECIPE = 1
_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
_PLAIN_SUFFIXES = (".jsonl", ".json", ".parquet")


def held_out(key: str, fraction: float) -> bool:
    """Whether the item named `key` belongs to the held-out split of size ~`fraction`.

    A pure function of the key (SHA-256), so every machine splits the same way.
    """
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"held-out fraction={fraction!r} is out of range; need 0 <= f < 1")
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return h < fraction * 2.0**64


def stdlib_corpus(
    split: str = "train", *, held_out_fraction: float = 0.05, max_files: int | None = None
) -> list[Path]:
    """The standard library's `.py` files (no tests, no site-packages), sorted by their
    path relative to the stdlib directory.

    `split` is "train", "val" (the files whose relative path hashes into the held-out
    fraction) or "all". `max_files` keeps the first files of the split, in that order.
    """
    if split not in ("train", "val", "all"):
        raise ConfigError(f"split={split!r} is not 'train', 'val' or 'all'")
    if max_files is not None and max_files < 1:
        raise ConfigError(f"max_files={max_files!r} must be >= 1 or None")
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    out = []
    for rel, path in found:
        if split != "all" and held_out(rel, held_out_fraction) != (split == "val"):
            continue
        out.append(path)
        if max_files is not None and len(out) >= max_files:
            break
    return out


def read_budget(paths: Iterable[str | os.PathLike[str]], budget: int) -> list[str]:
    """The UTF-8 texts of `paths`, in order, until about `budget` characters are read;
    unreadable or non-UTF-8 files are skipped."""
    texts, total = [], 0
    for p in paths:
        try:
            t = Path(p).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(t)
        total += len(t)
        if total >= budget:
            break
    return texts


def _expand(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            out.extend(sorted(q for q in p.rglob("*") if q.is_file()))
        elif p.is_file():
            out.append(p)
        else:
            raise ConfigError(f"text file {str(p)!r} does not exist; pass files or directories")
    return out


def _column(rows: Any, field: str, path: Path) -> list[str]:
    if field not in rows.column_names:
        raise ConfigError(
            f"{str(path)!r} has no {field!r} field (fields: {sorted(rows.column_names)}); "
            "pass text_field= to name the one holding the text"
        )
    return [str(t) for t in rows[field] if t]


def read_texts(paths: Iterable[str | os.PathLike[str]], text_field: str = "text") -> list[str]:
    """The documents in `paths` (files, or directories read recursively in sorted order).

    `.jsonl`/`.json` and `.parquet` give one document per row (its `text_field`), read
    through `datasets` when installed (jsonl also without it); any other file is one
    document, read as UTF-8 (undecodable bytes replaced).
    """
    texts: list[str] = []
    for path in _expand(paths):
        suffix = path.suffix.lower()
        if suffix not in _PLAIN_SUFFIXES:
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
            continue
        try:
            import datasets
        except ImportError:
            datasets = None
        if datasets is not None:
            builder = "parquet" if suffix == ".parquet" else "json"
            rows = datasets.load_dataset(builder, data_files=str(path), split="train")
            texts.extend(_column(rows, text_field, path))
        elif suffix == ".parquet":
            raise MissingExtra("lightning", f"reading {str(path)!r} (datasets)")
        else:
            with path.open(encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        value = json.loads(line).get(text_field)
                        if value:
                            texts.append(str(value))
    return texts


def _digest(texts: Sequence[str], vocab_size: int, min_frequency: int) -> str:
    import tokenizers

    h = hashlib.sha256()
    head = f"{_TOKENIZER_RECIPE}|{tokenizers.__version__}|{vocab_size}|{min_frequency}|"
    h.update(head.encode())
    for text in texts:
        data = text.encode("utf-8", errors="replace")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:32]


def _wrap(tokenizer_object: Any) -> PreTrainedTokenizerFast:
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError as exc:
        raise MissingExtra("lightning", "wrapping a tokenizer (transformers)") from exc

    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer_object,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        # Documents are cut into blocks by token_blocks, never by the tokenizer.
        model_max_length=2**62,
    )


def train_tokenizer(
    texts: Sequence[str],
    vocab_size: int = 4096,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    min_frequency: int = 2,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most `vocab_size` tokens trained on `texts`.

    Training is deterministic, so learners that train on the same texts get the same
    tokenizer. With `cache_dir`, the result is stored under a hash of the texts and the
    settings and loaded from there next time; concurrent trainers are safe (the first
    to finish publishes its directory with an atomic rename).
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 257:
        raise ConfigError(
            f"vocab_size={vocab_size!r} must be an int >= 257 (256 bytes plus {EOS_TOKEN})"
        )
    if not texts:
        raise ConfigError("train_tokenizer got no texts; pass at least one document")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:
        raise MissingExtra("lightning", "training a tokenizer") from exc
    target: Path | None = None
    if cache_dir is not None:
        target = Path(cache_dir) / f"bpe-{_digest(texts, vocab_size, min_frequency)}"
        if (target / "tokenizer.json").is_file():
            return _wrap(Tokenizer.from_file(str(target / "tokenizer.json")))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast: PreTrainedTokenizerFast = _wrap(tok)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        try:
            fast.save_pretrained(str(tmp))
            # Another process may have published the same directory meanwhile: equal
            # inputs give equal tokenizers, so losing that race changes nothing.
            with contextlib.suppress(OSError):
                os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return fast


def token_blocks(tokenizer: Any, texts: Sequence[str], block_size: int) -> torch.Tensor:
    """`texts` tokenized, each followed by the eos id, concatenated and cut into rows of
    `block_size` tokens: a LongTensor `[n, block_size]` (the tail that fills no row is
    dropped). Raises ConfigError when the texts make no full row."""
    import numpy as np
    import torch

    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ConfigError(f"block_size={block_size!r} must be an int >= 2")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError(f"tokenizer {type(tokenizer).__name__} has no eos token id")
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    lengths = [len(x) + 1 for x in ids]
    total = sum(lengths)
    n = total // block_size
    if n == 0:
        raise ConfigError(
            f"the texts hold {total} tokens, fewer than one block of block_size={block_size}; "
            "pass more text or a smaller block_size"
        )
    flat = np.empty(total, dtype=np.int64)
    at = 0
    for row in ids:
        flat[at : at + len(row)] = row
        flat[at + len(row)] = eos
        at += len(row) + 1
    return torch.from_numpy(flat[: n * block_size].reshape(n, block_size).copy())


def tiny_gpt2(
    vocab_size: int,
    n_layer: int = 2,
    n_embd: int = 128,
    n_head: int = 4,
    n_positions: int = 128,
    *,
    dropout: float = 0.0,
    bos_token_id: int = 0,
    eos_token_id: int = 0,
    seed: int | None = None,
) -> GPT2LMHeadModel:
    """A freshly initialised `GPT2LMHeadModel` (tied embeddings), built from a
    `GPT2Config` without any download. `seed` makes the initialisation reproducible."""
    try:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as exc:
        raise MissingExtra("lightning", "building a GPT-2 model") from exc
    for name, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        if not 0 <= value < vocab_size:
            raise ConfigError(f"{name}={value} is outside the vocabulary [0, {vocab_size})")
    if n_embd % n_head:
        raise ConfigError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    if seed is None:
        model = GPT2LMHeadModel(config)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = GPT2LMHeadModel(config)
    # Named, so transformers does not warn about an unrecognised loss_type=None.
    model.loss_type = "ForCausalLM"
    return model
