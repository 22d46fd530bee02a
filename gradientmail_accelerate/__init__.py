"""gradientmail for Accelerate: one learner per `accelerate launch`, driven by
`optimizer.step()`.

    from gradientmail_accelerate import DiLoCo, DiLoCoPlugin

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with DiLoCo(accelerator, model, optimizer, DiLoCoPlugin.from_env()) as diloco:
        ...  # the usual loop; optionally diloco.count(batch) per micro-batch

`DiLoCoPlugin` holds the settings (in code, or from `GRADIENTMAIL_CONFIG`'s YAML file and
`GRADIENTMAIL_*` variables); `DiLoCo` is the wrapper (a context manager).
"""

from gradientmail_accelerate.plugin import DEFAULT_ALGORITHM, DiLoCoPlugin
from gradientmail_accelerate.wrapper import DiLoCo, count_tokens

__all__ = ["DEFAULT_ALGORITHM", "DiLoCo", "DiLoCoPlugin", "count_tokens"]
