"""`gradientmail.keyspace`, a public name of the design, kept as a re-export of
`gradientmail.run.keyspace`."""

from gradientmail.run.keyspace import *  # noqa: F403
from gradientmail.run.keyspace import __all__ as __all__
