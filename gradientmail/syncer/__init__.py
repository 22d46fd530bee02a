"""The syncer: closing rounds.

Its pure decisions (`state`, `screening`, `merging`, and the roll call's closer side in
`caller`), and `Syncer`, the loop that carries them out (`runtime`), standalone or on a
learner's communication thread.
"""

from gradientmail.run.replica import theta_digest
from gradientmail.syncer.runtime import Syncer

__all__ = ["Syncer", "theta_digest"]
