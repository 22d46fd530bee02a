"""The run's newest committed model, read from its bucket in one call.

    state = gradientmail.load_committed("s3://bucket/run")      # name -> torch.Tensor
    gradientmail.load_committed("s3://bucket/run", model)       # copied into the model
    committed = gradientmail.read_committed("s3://bucket/run")  # and which round it is
    committed.round, committed.versions, committed.load_into(model)

What `gradientmail export` writes, without async internals: every parameter at its
fragment's newest committed version (Θ⁰ for a fragment never committed). With a replicated
outer step the fragments are rebuilt from their newest checkpoint and the steps since.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gradientmail.errors import SchemaMismatch
from gradientmail.mailbox.base import Mailbox
from gradientmail.mailbox.url import open_mailbox
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import newest_model
from gradientmail.wire.tensor_bytes import TensorBytes

if TYPE_CHECKING:
    import torch

__all__ = ["CommittedModel", "load_committed", "read_committed"]


@dataclasses.dataclass(frozen=True)
class CommittedModel:
    """A run's newest committed parameters and where in the run they are.

    `tensors` are in schema order, framework-free; `round` is the newest committed round
    (-1: none yet, every fragment at Θ⁰), `versions` each fragment's version (0: Θ⁰),
    `url` the mailbox's own URL (`file:///...` for a directory). `metadata` is what
    `gradientmail export` stores in the safetensors header.
    """

    tensors: Mapping[str, TensorBytes]
    round: int
    versions: tuple[int, ...]
    url: str

    @property
    def rounds_committed(self) -> int:
        return self.round + 1

    @property
    def metadata(self) -> dict[str, str]:
        return {
            "format": "pt",
            "gradientmail.url": self.url,
            "gradientmail.round": str(self.round),
            "gradientmail.versions": json.dumps(list(self.versions)),
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters as CPU torch tensors by name (needs torch)."""
        from gradientmail.adapters.torch import to_torch

        return {name: to_torch(t) for name, t in self.tensors.items()}

    def load_into(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Copy the parameters into `model`, whose parameters must be the run's (the same
        names and shapes: else `SchemaMismatch` naming each one, and the model is left as
        it was); returns `state_dict()`."""
        import torch

        state = self.state_dict()
        params = dict(model.named_parameters())
        problems = [f"the model has no parameter {n!r}" for n in state if n not in params]
        problems += [
            f"{n!r} is {list(params[n].shape)} in the model, {list(t.shape)} in the run"
            for n, t in state.items() if n in params and tuple(params[n].shape) != tuple(t.shape)
        ]
        problems += [f"the run has no parameter {n!r}" for n in params if n not in state]
        if problems:
            raise SchemaMismatch(
                "this model does not match the run in "
                f"{self.url}: " + "; ".join(problems) + ". Use the run's model definition"
            )
        with torch.no_grad():
            for name, t in state.items():
                params[name].copy_(t)
        return state


def read_committed(
    mailbox: Mailbox | str,
    *,
    run_key: str | bytes | None = None,
    prefix: str = "",
    **options: Any,
) -> CommittedModel:
    """The newest committed model of the run in `mailbox` (a Mailbox, left open, or a URL,
    opened read-only with `open_mailbox`'s `options` and closed: a mistyped path is
    reported, never created), with its round and versions.

    `run_key` reads an authenticated run (`AuthenticationError` when it is not the run's);
    `ConfigError` when the mailbox holds no run. Needs no torch.
    """
    if not isinstance(mailbox, Mailbox):
        options.setdefault("read_only", True)
    box = open_mailbox(mailbox, **options)
    # Errors name the URL as the caller wrote it; the result carries the mailbox's own.
    url = mailbox if isinstance(mailbox, str) else box.url

    async def read() -> CommittedModel:
        ex = Exchange(box, prefix=prefix, run_key=run_key)
        try:
            tensors, metadata = await newest_model(ex, url)
        finally:
            if not isinstance(mailbox, Mailbox):
                await box.close()
        return CommittedModel(tensors, int(metadata["gradientmail.round"]),
                              tuple(json.loads(metadata["gradientmail.versions"])), box.url)

    return asyncio.run(read())


def load_committed(
    mailbox: Mailbox | str,
    model: torch.nn.Module | None = None,
    *,
    run_key: str | bytes | None = None,
    prefix: str = "",
    **options: Any,
) -> dict[str, torch.Tensor]:
    """The newest committed parameters of the run in `mailbox` (a Mailbox or a URL, with
    the mailbox `options` of `open_mailbox`), as CPU tensors by name; copied into `model`
    when one is given (its parameters must be the run's: the same names and shapes).

    `run_key` reads an authenticated run (`AuthenticationError` when it is not the run's).
    `ConfigError` when the mailbox holds no run; `SchemaMismatch` naming each parameter the
    model lacks, has in another shape, or has beyond the run's. `read_committed` also
    says which round and versions the parameters are.
    """
    committed = read_committed(mailbox, run_key=run_key, prefix=prefix, **options)
    if model is None:
        return committed.state_dict()
    return committed.load_into(model)
