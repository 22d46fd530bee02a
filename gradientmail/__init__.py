"""gradientmail: Decoupled + Streaming DiLoCo over a shared bucket."""

from gradientmail.errors import GradientmailError

__version__ = "0.1.0"

__all__ = ["GradientmailError", "__version__"]
