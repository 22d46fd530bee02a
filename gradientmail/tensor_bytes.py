"""`gradientmail.tensor_bytes`, a public name of the design, kept as a re-export of
`gradientmail.wire.tensor_bytes`."""

from gradientmail.wire.tensor_bytes import *  # noqa: F403
from gradientmail.wire.tensor_bytes import __all__ as __all__
