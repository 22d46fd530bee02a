"""`gradientmail.compression`, a public name of the design, kept as a re-export of
`gradientmail.wire.compression`."""

from gradientmail.wire.compression import *  # noqa: F403
from gradientmail.wire.compression import __all__ as __all__
