"""`gradientmail.auth`, a public name of the design, kept as a re-export of
`gradientmail.wire.auth`."""

from gradientmail.wire.auth import *  # noqa: F403
from gradientmail.wire.auth import __all__ as __all__
