"""gradientmail.integration.textdata: the stdlib corpus, reading files, the cached BPE tokenizer,
token blocks and the tiny GPT-2 — all offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

# Before any Hugging Face import: they read it once. Tests never download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from gradientmail.errors import ConfigError
from gradientmail.integration import textdata as td

DOCS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
] * 20


@pytest.mark.slow
def test_import_needs_no_hugging_face_library() -> None:
    code = (
        "import sys, gradientmail.integration.textdata\n"
        "print(sorted(m for m in ('transformers', 'tokenizers', 'datasets')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_stdlib_corpus_is_sorted_split_and_skips_tests() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    train = td.stdlib_corpus("train")
    val = td.stdlib_corpus("val")
    every = td.stdlib_corpus("all")
    rel = [p.relative_to(root).as_posix() for p in every]
    assert rel == sorted(rel)
    assert "os.py" in rel and "json/decoder.py" in rel
    assert not any(part in ("test", "tests", "site-packages") for r in rel for part in r.split("/"))
    assert set(train).isdisjoint(val)
    assert sorted(train + val) == sorted(every)
    assert 0.01 < len(val) / len(every) < 0.10  # the default held-out fraction is 5%
    for p in val:
        assert td.held_out(p.relative_to(root).as_posix(), 0.05)
    assert td.stdlib_corpus("train", max_files=3) == train[:3]
    with pytest.raises(ConfigError, match=r"split='test' is not 'train', 'val' or 'all'"):
        td.stdlib_corpus("test")


def test_held_out_is_a_stable_function_of_the_key() -> None:
    # Pinned: the first 8 bytes of sha256("json/decoder.py") are 0.2312 of 2**64.
    assert td.held_out("json/decoder.py", 0.2312) is True
    assert td.held_out("json/decoder.py", 0.2311) is False
    assert td.held_out("os.py", 0.0) is False
    keys = [f"doc-{i}" for i in range(2000)]
    share = sum(td.held_out(k, 0.25) for k in keys) / len(keys)
    assert 0.2 < share < 0.3
    assert [td.held_out(k, 0.25) for k in keys] == [td.held_out(k, 0.25) for k in keys]
    with pytest.raises(ConfigError, match=r"fraction=1.0 is out of range"):
        td.held_out("x", 1.0)


def test_read_texts_txt_jsonl_parquet_and_directories(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first document\nstill the first")
    with open(tmp_path / "b.jsonl", "w") as f:
        for text in ("row one", "", "row two"):
            f.write(json.dumps({"text": text, "id": 1}) + "\n")
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    pq.write_table(pa.table({"body": ["p1", "p2"]}), tmp_path / "c.parquet")
    assert td.read_texts([tmp_path / "a.txt", tmp_path / "b.jsonl"]) == [
        "first document\nstill the first",
        "row one",
        "row two",
    ]
    assert td.read_texts([tmp_path / "c.parquet"], text_field="body") == ["p1", "p2"]
    with pytest.raises(ConfigError, match=r"has no 'text' field \(fields: \['body'\]\)"):
        td.read_texts([tmp_path / "c.parquet"])
    sub = tmp_path / "dir"
    sub.mkdir()
    (sub / "z.txt").write_text("z")
    (sub / "y.txt").write_text("y")
    assert td.read_texts([sub]) == ["y", "z"]
    with pytest.raises(ConfigError, match=r"does not exist"):
        td.read_texts([tmp_path / "missing.txt"])


def test_tokenizer_is_trained_once_cached_and_deterministic(tmp_path: Path) -> None:
    tok = td.train_tokenizer(DOCS, vocab_size=300, cache_dir=tmp_path)
    (entry,) = tmp_path.iterdir()
    assert entry.name.startswith("bpe-") and (entry / "tokenizer.json").is_file()
    assert tok.eos_token == tok.bos_token == td.EOS_TOKEN
    assert tok.eos_token_id == tok.bos_token_id == 0
    assert len(tok) <= 300
    ids = tok("def add(a, b):")["input_ids"]
    assert tok.decode(ids) == "def add(a, b):"
    assert max(ids) < len(tok)
    # From the cache (same inputs), and from scratch elsewhere: the same vocabulary.
    again = td.train_tokenizer(DOCS, vocab_size=300, cache_dir=tmp_path)
    fresh = td.train_tokenizer(DOCS, vocab_size=300)
    assert again.get_vocab() == tok.get_vocab() == fresh.get_vocab()
    assert len(list(tmp_path.iterdir())) == 1
    td.train_tokenizer(DOCS, vocab_size=280, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2
    # The cache entry is a tokenizer directory transformers loads by itself.
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(entry)).get_vocab() == tok.get_vocab()
    with pytest.raises(ConfigError, match=r"vocab_size=100 must be an int >= 257"):
        td.train_tokenizer(DOCS, vocab_size=100)


def test_token_blocks_concatenate_with_eos_and_drop_the_tail() -> None:
    tok = td.train_tokenizer(DOCS, vocab_size=300)
    texts = ["for i in range(10):", "print(i)"]
    a = tok(texts[0], add_special_tokens=False)["input_ids"]
    b = tok(texts[1], add_special_tokens=False)["input_ids"]
    stream = [*a, 0, *b, 0]
    blocks = td.token_blocks(tok, texts, 4)
    n = len(stream) // 4
    assert blocks.shape == (n, 4)
    assert str(blocks.dtype) == "torch.int64"
    assert blocks.reshape(-1).tolist() == stream[: n * 4]
    with pytest.raises(ConfigError, match=r"fewer than one block of block_size=4096"):
        td.token_blocks(tok, texts, 4096)


def test_tiny_gpt2_is_built_offline_and_seeded() -> None:
    import torch

    m = td.tiny_gpt2(512, n_layer=1, n_embd=32, n_head=2, n_positions=16, seed=3)
    same = td.tiny_gpt2(512, n_layer=1, n_embd=32, n_head=2, n_positions=16, seed=3)
    cfg = m.config
    assert (cfg.vocab_size, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_positions) == (
        512,
        1,
        32,
        2,
        16,
    )
    assert cfg.bos_token_id == cfg.eos_token_id == 0
    for (n, p), (_, q) in zip(m.named_parameters(), same.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    x = torch.randint(0, 512, (2, 16))
    loss = m(input_ids=x, labels=x).loss.detach()
    assert abs(float(loss) - float(torch.log(torch.tensor(512.0)))) < 0.5
    with pytest.raises(ConfigError, match=r"eos_token_id=600 is outside the vocabulary"):
        td.tiny_gpt2(512, eos_token_id=600)
    with pytest.raises(ConfigError, match=r"n_embd=30 is not divisible by n_head=4"):
        td.tiny_gpt2(512, n_embd=30)
