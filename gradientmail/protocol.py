"""`gradientmail.protocol`, a public name of the design, kept as a re-export of
`gradientmail.run.protocol`."""

from gradientmail.run.protocol import *  # noqa: F403
from gradientmail.run.protocol import __all__ as __all__
