"""`gradientmail.quantization`, a public name of the design, kept as a re-export of
`gradientmail.wire.quantization`."""

from gradientmail.wire.quantization import *  # noqa: F403
from gradientmail.wire.quantization import __all__ as __all__
