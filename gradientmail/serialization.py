"""`gradientmail.serialization`, a public name of the design, kept as a re-export of
`gradientmail.wire.serialization`."""

from gradientmail.wire.serialization import *  # noqa: F403
from gradientmail.wire.serialization import __all__ as __all__
