"""gradientmail for Lightning: `DiLoCoCallback` makes a `Trainer` one learner of a run.

The GPT-2 recipe pieces live in submodules: `gradientmail_lightning.gpt2.GPT2Module`,
`gradientmail_lightning.data.TextDataModule` and the `gradientmail-train` command
(`gradientmail_lightning.cli`).
"""

from gradientmail_lightning.callback import DiLoCoCallback

__all__ = ["DiLoCoCallback"]
