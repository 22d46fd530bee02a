"""The integration core shared by `gradientmail_lightning` and `gradientmail_accelerate`.

One learner per launch, whatever the framework: `RankSync` keeps the processes of a
DDP group on rank 0's parameters over a small `Ranks` contract of collectives
(`TorchRanks` for a `torch.distributed` group, `SingleRank`, and the `ThreadRanks` fake);
`count_tokens` is the one rule for how many tokens a batch holds; `METRICS` names and
explains the `diloco/...` metrics both report, which `RunMetrics` accumulates; and
`per_process_batch`, `BatchSizes` and `ShareBatchSampler` size batches to the learner's
share of `global_batch_size`; `learners_to_await` says how many learners to wait for at
train start. With `ShardedRanks`, the ranks each mail and read their own
rows instead (FSDP2 shards, or a DDP group splitting its upload). Needs torch.
"""

from gradientmail.integration.batches import (
    BatchSizeHook,
    BatchSizes,
    ShareBatchSampler,
    per_process_batch,
)
from gradientmail.integration.losses import LossMean, output_loss
from gradientmail.integration.metrics import METRICS, PREFIX, RunMetrics
from gradientmail.integration.ranks import Ranks, SingleRank, ThreadRanks, TorchRanks
from gradientmail.integration.sharded import ShardedRanks
from gradientmail.integration.sync import RankSync
from gradientmail.integration.together import check_wait, learners_to_await
from gradientmail.integration.tokens import count_tokens

__all__ = [
    "METRICS",
    "PREFIX",
    "BatchSizeHook",
    "BatchSizes",
    "LossMean",
    "RankSync",
    "Ranks",
    "RunMetrics",
    "ShardedRanks",
    "ShareBatchSampler",
    "SingleRank",
    "ThreadRanks",
    "TorchRanks",
    "check_wait",
    "count_tokens",
    "learners_to_await",
    "output_loss",
    "per_process_batch",
]
