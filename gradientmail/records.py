"""`gradientmail.records`, a public name of the design, kept as a re-export of
`gradientmail.wire.records`."""

from gradientmail.wire.records import *  # noqa: F403
from gradientmail.wire.records import __all__ as __all__
