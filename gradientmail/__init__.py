"""gradientmail: Decoupled + Streaming DiLoCo over a shared bucket.

Learners train their own copy of a model and mail the change they made to one fragment
of it to an object store; whoever closes the round merges what arrived with DiLoCo's
outer step and publishes the new fragment. The store's conditional writes are the only
coordination.
"""

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.merge import Rda, WeightedMean
from gradientmail.algorithms.partition import ByBytes, Strided
from gradientmail.errors import GradientmailError
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.mailbox import open_mailbox
from gradientmail.run.committed import CommittedModel, load_committed, read_committed
from gradientmail.syncer.runtime import Syncer

__version__ = "0.1.0"

__all__ = [
    "ByBytes",
    "CommittedModel",
    "DiLoCo",
    "GradientmailError",
    "Learner",
    "LearnerOptions",
    "Rda",
    "Strided",
    "Syncer",
    "WeightedMean",
    "__version__",
    "load_committed",
    "open_mailbox",
    "read_committed",
]
