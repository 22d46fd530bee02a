"""The run's newest committed model, read from its bucket in one call.

    state = gradientmail.load_committed("s3://bucket/run")      # name -> torch.Tensor
    gradientmail.load_committed("s3://bucket/run", model)       # copied into the model

What `gradientmail export` writes, without async internals: every parameter at its
fragment's newest committed version (Θ⁰ for a fragment never committed). With a replicated
outer step the fragments are rebuilt from their newest checkpoint and the steps since.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from gradientmail.errors import SchemaMismatch
from gradientmail.mailbox.base import Mailbox
from gradientmail.mailbox.url import open_mailbox
from gradientmail.run.protocol import Exchange
from gradientmail.run.replica import newest_model

if TYPE_CHECKING:
    import torch

__all__ = ["load_committed"]


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
    model lacks, has in another shape, or has beyond the run's.
    """
    import torch

    from gradientmail.adapters.torch import to_torch

    box = open_mailbox(mailbox, **options)

    async def read() -> dict[str, Any]:
        ex = Exchange(box, prefix=prefix, run_key=run_key)
        try:
            tensors, _ = await newest_model(ex, box.url)
        finally:
            if not isinstance(mailbox, Mailbox):
                await box.close()
        return tensors

    state = {name: to_torch(t) for name, t in asyncio.run(read()).items()}
    if model is not None:
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
                f"{box.url}: " + "; ".join(problems) + ". Use the run's model definition"
            )
        with torch.no_grad():
            for name, t in state.items():
                params[name].copy_(t)
    return state
