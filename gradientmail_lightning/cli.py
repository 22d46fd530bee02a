"""`gradientmail-train`: the GPT-2 recipes as a LightningCLI with a `diloco:` section.

    gradientmail-train fit --config recipes/gpt2-tiny-cpu.yaml \\
        --diloco.learner_id learner-1 --trainer.max_steps 600

The YAML has LightningCLI's `trainer:`, `model:` (GPT2Module) and `data:`
(TextDataModule) sections plus `diloco:`, whose keys are the arguments of
`diloco_callback`: the mailbox URL, the learner id and the DiLoCo fields, flat.
`data.vocab_size` and `data.block_size` are linked into the model, and
`diloco.learner_id` into the data module (which derives the learner's shard from it).
The run key of an authenticated run comes from `GRADIENTMAIL_RUN_KEY`, as for the
`gradientmail` command: a secret does not belong in a recipe.
"""

from __future__ import annotations

from typing import Literal

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from gradientmail.algorithms.diloco import ByBytes, DiLoCo, Rda, Strided, WeightedMean
from gradientmail.learner.runtime import WAIT_TIMEOUT
from gradientmail_lightning.callback import DiLoCoCallback
from gradientmail_lightning.data import TextDataModule
from gradientmail_lightning.gpt2 import GPT2Module

__all__ = ["GradientmailCLI", "diloco_callback", "main"]


def diloco_callback(
    mailbox: str,
    learner_id: str | None = None,
    sync_every: int = 100,
    fragments: int = 1,
    in_flight: int = 1,
    overlap_steps: int | None = None,
    mixing: float = 0.0,
    quorum_size: int = 1,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    merge: Literal["rda", "mean"] = "rda",
    direct_pattern: str | None = "embed",
    partition: Literal["bytes", "strided"] = "bytes",
    block_pattern: str = r"\.(\d+)\.",
    global_batch_size: int | None = None,
    delta_dtype: Literal["F32", "BF16", "F8_E4M3", "F4"] | None = None,
    commit_dtype: Literal["BF16", "F8_E4M3", "F4"] | None = None,
    flush_on_close: bool = True,
    rebase: bool | None = None,
    outlier_factor: float | None = None,
    checkpoint_every: int = 20,
    keep_rounds: int | None = None,
    sync: bool = True,
    poll_interval: float = 1.0,
    compression: Literal["off", "zstd"] = "off",
    lease_every: float = 60.0,
    lease_timeout: float = 120.0,
    prefix: str = "",
    log_every_n_steps: int | None = None,
    tokens_per_step: int | None = None,
    wait_for_learners: int | None = None,
    wait_timeout: float = WAIT_TIMEOUT,
) -> DiLoCoCallback:
    """A DiLoCoCallback from flat settings: `merge` "rda" (with `direct_pattern`) or
    "mean"; `partition` "bytes" or "strided" (with `block_pattern`); the rest are
    `DiLoCo`'s and `Learner`'s arguments of the same names; `tokens_per_step` the
    callback's (the tokens of every batch, when fixed: no all-reduce of the ranks' counts
    per step; None counts each batch) and `wait_for_learners`/`wait_timeout` (how many
    learners to wait for at train start, by default those a barrier needs; 0 starts at
    once);
    `GRADIENTMAIL_RUN_KEY`, when set, is the run key
    (the Learner's default)."""
    algorithm = DiLoCo(
        sync_every=sync_every,
        fragments=fragments,
        in_flight=in_flight,
        overlap_steps=overlap_steps,
        mixing=mixing,
        quorum_size=quorum_size,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        merge=Rda(direct_pattern=direct_pattern) if merge == "rda" else WeightedMean(),
        partition=Strided(block_pattern) if partition == "strided" else ByBytes(),
        global_batch_size=global_batch_size,
        delta_dtype=delta_dtype,
        commit_dtype=commit_dtype,
        flush_on_close=flush_on_close,
        rebase=rebase,
        outlier_factor=outlier_factor,
        checkpoint_every=checkpoint_every,
        keep_rounds=keep_rounds,
    )
    # No run_key: the Learner takes GRADIENTMAIL_RUN_KEY itself.
    return DiLoCoCallback(
        mailbox,
        algorithm,
        learner_id=learner_id,
        tokens_per_step=tokens_per_step,
        sync=sync,
        poll_interval=poll_interval,
        compression=compression,
        log_every_n_steps=log_every_n_steps,
        lease_every=lease_every,
        lease_timeout=lease_timeout,
        prefix=prefix,
        wait_for_learners=wait_for_learners,
        wait_timeout=wait_timeout,
    )


class GradientmailCLI(LightningCLI):
    """LightningCLI for GPT2Module + TextDataModule with a top-level `diloco:` section."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(diloco_callback, "diloco")
        parser.link_arguments("data.vocab_size", "model.vocab_size")
        parser.link_arguments("data.block_size", "model.block_size")
        parser.link_arguments("diloco.learner_id", "data.learner_id")


def main(args: list[str] | None = None) -> None:
    """The `gradientmail-train` console script."""
    GradientmailCLI(
        GPT2Module,
        TextDataModule,
        args=args,
        save_config_kwargs={"overwrite": True},
    )
