"""TextDataModule: token blocks for GPT-2 pretraining, one shard per learner.

Sources, in order of precedence: `files` (local .txt/.jsonl/.parquet files or
directories), `dataset` (a hub dataset name, usually with `streaming=True`), or the
running Python's standard library (`gradientmail.integration.textdata.stdlib_corpus`), which needs
no download. The tokenizer is a directory or hub name (`tokenizer=`), or, by default, a
byte-level BPE of `vocab_size` tokens trained on the whole training text (before
sharding, so every learner gets the same one) and cached in `cache_dir`.

Each learner trains on its own shard: document i of the training text goes to shard
i mod `num_shards`; the shard is `shard`, or derived from `learner_id` (see
`learner_shard`), and the shuffle seed is `seed` plus the shard. Held-out documents
(a hash of their content, `val_fraction`) form the validation set, the same for every
learner. Under DDP the map-style path relies on Lightning's distributed sampler; the
streaming path splits its shard by global rank itself.

With `global_batch_size`, `resize_batches` (the callback's batch-size hook) sizes the
training batches from the next one drawn: the map-style path draws them through a
`ShareBatchSampler`; on the streaming path the loader workers only pack blocks and the
main process forms the batches, since workers never see a new share. One batch of a
stream keeps `batch_size`: the first, which Lightning draws from a loader without a
length before `on_train_start`, where the learner joins and learns its share (set
`batch_size` to the expected share to avoid it).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, default_collate

from gradientmail.errors import ConfigError, MissingExtra
from gradientmail.integration import BatchSizes, ShareBatchSampler
from gradientmail.integration.textdata import (
    held_out,
    read_texts,
    stdlib_corpus,
    token_blocks,
    train_tokenizer,
)

__all__ = ["TextDataModule", "learner_shard"]

_TRAILING_INT = re.compile(r"(\d+)$")


def learner_shard(learner_id: str, num_shards: int) -> int:
    """The shard of `learner_id` among `num_shards`: its trailing number modulo
    `num_shards` (so "learner-0", "learner-1", … fill the shards in order), else a CRC-32
    of the id modulo `num_shards`."""
    if num_shards < 1:
        raise ConfigError(f"num_shards={num_shards} must be >= 1")
    match = _TRAILING_INT.search(learner_id)
    if match is not None:
        return int(match.group(1)) % num_shards
    return zlib.crc32(learner_id.encode()) % num_shards


def _doc_key(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", errors="replace")).hexdigest()


class _Blocks(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i]}


class _StreamBlocks(IterableDataset[dict[str, torch.Tensor]]):
    """Blocks packed on the fly from a (streaming) `datasets` iterable."""

    def __init__(
        self,
        stream: Any,
        tokenizer: Any,
        block_size: int,
        text_field: str,
        val_fraction: float,
        val: bool,
        limit: int | None,
    ) -> None:
        self.stream = stream
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.text_field = text_field
        self.val_fraction = val_fraction
        self.val = val
        self.limit = limit

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        eos = self.tokenizer.eos_token_id
        buf: list[int] = []
        made = 0
        for row in self.stream:
            text = row.get(self.text_field)
            if not text or held_out(_doc_key(text), self.val_fraction) != self.val:
                continue
            buf.extend(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            buf.append(eos)
            while len(buf) >= self.block_size:
                block, buf = buf[: self.block_size], buf[self.block_size :]
                yield {"input_ids": torch.tensor(block, dtype=torch.long)}
                made += 1
                if self.limit is not None and made >= self.limit:
                    return


class _StreamBatches:
    """Batches of `size()` blocks of a stream, formed in the main process.

    A DataLoader with `batch_size` forms batches inside its workers, which never see a
    new share: the size is read in the main process, at every batch, so a share applies
    from the next batch. The workers (`num_workers`) still tokenize and pack the blocks.
    A final shorter batch is kept.
    """

    def __init__(
        self,
        blocks: IterableDataset[dict[str, torch.Tensor]],
        size: Callable[[], int],
        num_workers: int,
    ) -> None:
        self.blocks = blocks
        self.size = size
        self.num_workers = num_workers

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        loader = DataLoader(self.blocks, batch_size=None, num_workers=self.num_workers)
        stream = iter(loader)
        while True:
            batch = list(itertools.islice(stream, self.size()))
            if not batch:
                return
            out: dict[str, torch.Tensor] = default_collate(batch)
            yield out


class TextDataModule(LightningDataModule):
    """Token blocks of `block_size` from local files, a hub dataset or the stdlib corpus.

    `max_documents` keeps the first documents of a map-style source (small smoke runs);
    `val_blocks` caps the validation set; `tokenizer_documents` is how many documents of a
    stream train the tokenizer.
    """

    def __init__(
        self,
        files: list[str] | None = None,
        dataset: str | None = None,
        dataset_config: str | None = None,
        dataset_split: str = "train",
        text_field: str = "text",
        streaming: bool = False,
        tokenizer: str | None = None,
        vocab_size: int = 4096,
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.02,
        val_blocks: int = 64,
        max_documents: int | None = None,
        tokenizer_documents: int = 20000,
        cache_dir: str | None = None,
        learner_id: str | None = None,
        shard: int | None = None,
        num_shards: int = 1,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if files and dataset:
            raise ConfigError(f"pass either files={files!r} or dataset={dataset!r}, not both")
        if num_shards < 1:
            raise ConfigError(f"num_shards={num_shards} must be >= 1")
        if shard is not None and not 0 <= shard < num_shards:
            raise ConfigError(f"shard={shard} is out of range; need 0 <= shard < {num_shards}")
        for name, value in (("batch_size", batch_size), ("val_blocks", val_blocks)):
            if value < 1:
                raise ConfigError(f"{name}={value} must be >= 1")
        if max_documents is not None and max_documents < 1:
            raise ConfigError(f"max_documents={max_documents} must be >= 1, or None")
        if not 0.0 <= val_fraction < 1.0:
            raise ConfigError(f"val_fraction={val_fraction!r} is out of range; need 0 <= f < 1")
        self.files = list(files) if files else None
        self.dataset = dataset
        self.dataset_config = dataset_config
        self.dataset_split = dataset_split
        self.text_field = text_field
        self.streaming = streaming
        self.tokenizer_name = tokenizer
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.val_blocks = val_blocks
        self.max_documents = max_documents
        self.tokenizer_documents = tokenizer_documents
        self.cache_dir = cache_dir
        self.learner_id = learner_id
        self.num_shards = num_shards
        if shard is None:
            shard = learner_shard(learner_id, num_shards) if learner_id is not None else 0
            if learner_id is None and num_shards > 1:
                raise ConfigError(
                    f"num_shards={num_shards} but neither shard nor learner_id is set; pass "
                    "shard= (0 <= shard < num_shards) or learner_id= to derive it"
                )
        self.shard = shard
        self.seed = seed + shard
        self.num_workers = num_workers
        self.tokenizer: Any = None
        self.batch_sizes = BatchSizes(default=batch_size)
        self._train: Dataset[dict[str, torch.Tensor]] | None = None
        self._val: Dataset[dict[str, torch.Tensor]] | None = None

    # -- sources -----------------------------------------------------------------------

    def _cache(self) -> Path:
        if self.cache_dir is not None:
            return Path(self.cache_dir)
        return Path.home() / ".cache" / "gradientmail" / "tokenizers"

    def _documents(self) -> tuple[list[str], list[str]]:
        """Train and held-out documents of a map-style source."""
        n = self.max_documents
        if self.files is None and self.dataset is None:
            frac = self.val_fraction
            train = read_texts(stdlib_corpus("train", held_out_fraction=frac, max_files=n))
            val = read_texts(stdlib_corpus("val", held_out_fraction=frac, max_files=n))
            return train, val
        if self.files is not None:
            docs = read_texts(self.files, self.text_field)
        else:
            docs = [str(t) for t in self._load(streaming=False)[self.text_field] if t]
        docs = docs[:n] if n is not None else docs
        train = [d for d in docs if not held_out(_doc_key(d), self.val_fraction)]
        val = [d for d in docs if held_out(_doc_key(d), self.val_fraction)]
        return train, val

    def _load(self, streaming: bool) -> Any:
        try:
            import datasets
        except ImportError as exc:
            raise MissingExtra("lightning", "loading a dataset (datasets)") from exc
        if self.dataset is not None:
            return datasets.load_dataset(
                self.dataset, self.dataset_config, split=self.dataset_split, streaming=streaming
            )
        assert self.files is not None
        suffix = Path(self.files[0]).suffix.lower()
        builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(suffix, "text")
        return datasets.load_dataset(
            builder, data_files=self.files, split="train", streaming=streaming
        )

    def _make_tokenizer(self, sample: Sequence[str]) -> Any:
        if self.tokenizer_name is not None:
            try:
                from transformers import AutoTokenizer
            except ImportError as exc:
                raise MissingExtra("lightning", "loading a tokenizer") from exc
            tok = AutoTokenizer.from_pretrained(self.tokenizer_name)
            tok.model_max_length = 2**62
        else:
            tok = train_tokenizer(sample, self.vocab_size, self._cache())
        if len(tok) > self.vocab_size:
            raise ConfigError(
                f"the tokenizer has {len(tok)} tokens but vocab_size={self.vocab_size}; "
                f"set data.vocab_size >= {len(tok)} (a multiple of 64 is fastest)"
            )
        if tok.eos_token_id is None:
            raise ConfigError(f"tokenizer {self.tokenizer_name!r} has no eos token")
        return tok

    # -- Lightning hooks ---------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        if self._train is not None:
            return
        if self.streaming:
            self._setup_stream()
            return
        train_docs, val_docs = self._documents()
        if not train_docs:
            raise ConfigError("the data source holds no training documents")
        self.tokenizer = self._make_tokenizer(train_docs)
        mine = train_docs[self.shard :: self.num_shards]
        if not mine:
            raise ConfigError(
                f"shard {self.shard} of {self.num_shards} holds no document "
                f"({len(train_docs)} in all); use fewer shards or more data"
            )
        self._train = _Blocks(token_blocks(self.tokenizer, mine, self.block_size))
        if val_docs:
            with_val = token_blocks(self.tokenizer, val_docs, self.block_size)
            self._val = _Blocks(with_val[: self.val_blocks])

    def _setup_stream(self) -> None:
        from datasets.distributed import split_dataset_by_node

        source = self._load(streaming=True)
        if self.tokenizer_name is None:
            sample = [
                str(row[self.text_field])
                for row in itertools.islice(source, self.tokenizer_documents)
                if row.get(self.text_field)
            ]
            self.tokenizer = self._make_tokenizer(sample)
        else:
            self.tokenizer = self._make_tokenizer(())
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        # Split before shuffling: every node must see the same shard order to know which
        # shards are its own (datasets' own warning); the learner's seed shuffles after.
        mine = split_dataset_by_node(
            source, rank=self.shard * world + rank, world_size=self.num_shards * world
        )
        mine = mine.shuffle(seed=self.seed, buffer_size=10_000)
        self._train = _StreamBlocks(
            mine, self.tokenizer, self.block_size, self.text_field, self.val_fraction, False, None
        )
        self._val = _StreamBlocks(
            source,
            self.tokenizer,
            self.block_size,
            self.text_field,
            self.val_fraction,
            True,
            self.val_blocks,
        )

    def train_dataloader(self) -> Iterable[dict[str, torch.Tensor]]:
        if self._train is None:
            self.setup("fit")
        assert self._train is not None
        if isinstance(self._train, IterableDataset):
            return _StreamBatches(self._train, self.batch_sizes, self.num_workers)
        assert isinstance(self._train, _Blocks)
        order = RandomSampler(self._train, generator=torch.Generator().manual_seed(self.seed))
        return DataLoader(
            self._train,
            batch_sampler=ShareBatchSampler(order, self.batch_size, True, self.batch_sizes),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def resize_batches(self, share: int) -> None:
        """The batch-size hook: this learner's share of `global_batch_size`, split over
        the Trainer's processes and gradient accumulation."""
        trainer = self.trainer
        processes = trainer.world_size if trainer is not None else 1
        accumulation = trainer.accumulate_grad_batches if trainer is not None else 1
        self.batch_sizes.set(share, processes, accumulation)

    def val_dataloader(self) -> Any:
        if self._train is None:
            self.setup("validate")
        if self._val is None:
            return []
        return DataLoader(self._val, batch_size=self.batch_size, shuffle=False)

    @property
    def train_blocks(self) -> int | float:
        """Blocks in this learner's shard (inf for a stream)."""
        if isinstance(self._train, _Blocks):
            return len(self._train)
        return math.inf
