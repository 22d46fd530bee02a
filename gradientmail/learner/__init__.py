"""The learner: `Learner`, a training loop's side of a run.

Its pure decisions (`state`), its runtime on the training thread (`runtime`), and its
communication thread (`mailman`), which talks to the training thread only through the
messages of `messages` and fetches commits with `fetcher`.
"""

from gradientmail.learner.mailman import BACKUP_EVERY
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner, default_learner_id

__all__ = ["BACKUP_EVERY", "Learner", "LearnerOptions", "default_learner_id"]
