"""`gradientmail-train`: the GPT-2 recipes as a LightningCLI with a `diloco:` section.

    gradientmail-train fit --config recipes/gpt2-tiny-cpu.yaml \\
        --diloco.learner_id learner-1 --trainer.max_steps 600

The YAML has LightningCLI's `trainer:`, `model:` (GPT2Module) and `data:`
(TextDataModule) sections plus `diloco:`, whose keys are the arguments of
`diloco_callback`: the mailbox URL, the learner id, the DiLoCo fields and the
LearnerOptions settings, flat, with their defaults (docs/configuration.md).
`data.vocab_size` and `data.block_size` are linked into the model, and
`diloco.learner_id` into the data module (which derives the learner's shard from it).
The run key of an authenticated run comes from `GRADIENTMAIL_RUN_KEY`, as for the
`gradientmail` command: a secret does not belong in a recipe.
"""

from __future__ import annotations

from typing import Literal

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import Rda
from gradientmail.algorithms.partition import Strided
from gradientmail.algorithms.words import DILOCO_KEYS, diloco_from_mapping
from gradientmail.learner.options import LearnerOptions
from gradientmail_lightning.callback import DiLoCoCallback
from gradientmail_lightning.data import TextDataModule
from gradientmail_lightning.gpt2 import GPT2Module

__all__ = ["GradientmailCLI", "diloco_callback", "main"]


# The defaults of the signature below are DiLoCo's and LearnerOptions' own (read here,
# not restated), so `gradientmail-train` cannot drift from the Python API.
_D = DiLoCo()
_O = LearnerOptions()
_DIRECT = Rda().direct_pattern
_BLOCK = Strided().block_pattern


def diloco_callback(
    mailbox: str,
    learner_id: str | None = None,
    sync_every: int = _D.sync_every,
    fragments: int = _D.fragments,
    in_flight: int | None = None,
    overlap_steps: int | None = _D.overlap_steps,
    mixing: float = _D.mixing,
    quorum_size: int = _D.quorum_size,
    outer_lr: float = _D.outer_lr,
    outer_momentum: float = _D.outer_momentum,
    merge: Literal["rda", "mean"] = "rda",
    direct_pattern: str | None = _DIRECT,
    partition: Literal["bytes", "strided"] = "bytes",
    block_pattern: str = _BLOCK,
    global_batch_size: int | None = _D.global_batch_size,
    delta_dtype: Literal["F32", "BF16", "F8_E4M3", "F4", "TOPK_F8", "TOPK_Q2",
                         "SIGN1"] | None = None,
    commit_dtype: Literal["BF16", "F8_E4M3", "F4"] | None = None,
    flush_on_close: bool = _D.flush_on_close,
    rebase: bool | None = None,
    outlier_factor: float | None = _D.outlier_factor,
    checkpoint_every: int = _D.checkpoint_every,
    keep_rounds: int | None = _D.keep_rounds,
    delta_density: float | None = _D.delta_density,
    feedback_decay: float | None = _D.feedback_decay,
    feedback_momentum: float | None = _D.feedback_momentum,
    cohort_share: bool = _D.cohort_share,
    stagger: bool = _D.stagger,
    sync: bool = _O.sync,
    hold_own: bool = _O.hold_own,
    poll_interval: float = _O.poll_interval,
    lease_every: float = _O.lease_every,
    lease_timeout: float = _O.lease_timeout,
    compression: Literal["off", "zstd"] = "off",
    prefix: str = _O.prefix,
    keep_versions: int = _O.keep_versions,
    prices: dict[str, float] | None = None,
    wait_for_learners: int | None = _O.wait_for_learners,
    wait_timeout: float = _O.wait_timeout,
    log_every_n_steps: int | None = None,
    tokens_per_step: int | None = None,
) -> DiLoCoCallback:
    """A DiLoCoCallback from flat settings, named as `DiLoCo`'s and `LearnerOptions`'
    fields (docs/configuration.md): `merge` "rda" (with `direct_pattern`) or "mean";
    `partition` "bytes" or "strided" (with `block_pattern`); `prices` a mapping of
    `Prices` fields (None: S3 Standard). `tokens_per_step` and `log_every_n_steps` are
    the callback's (the tokens of every batch, when fixed: no all-reduce of the ranks'
    counts per step; None counts each batch). `GRADIENTMAIL_RUN_KEY`, when set, is the
    run key (the Learner's default)."""
    given = dict(locals())
    if merge == "mean":
        given.pop("direct_pattern")  # RDA's option: the mean has none
    if partition == "bytes":
        given.pop("block_pattern")
    algorithm = diloco_from_mapping(
        {k: given[k] for k in DILOCO_KEYS if k in given}, source="diloco", prefix="")
    options = LearnerOptions.from_mapping(
        {k: given[k] for k in LearnerOptions.names()}, source="diloco")
    # No run_key: the Learner takes GRADIENTMAIL_RUN_KEY itself.
    return DiLoCoCallback(
        mailbox,
        algorithm,
        learner_id=learner_id,
        tokens_per_step=tokens_per_step,
        log_every_n_steps=log_every_n_steps,
        options=options,
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
