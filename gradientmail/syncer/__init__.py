"""The syncer: closing rounds.

Its pure decisions (`state`, `screening`, `merging`, and the roll call's closer side in
`caller`), and `Syncer`, the loop that carries them out (`runtime`), standalone or on a
learner's communication thread.
"""

from gradientmail.syncer.runtime import Syncer, theta_digest

__all__ = ["Syncer", "theta_digest"]
