"""Data-parallel gradient synchronization (public face of cannjax.transforms.parallel)."""

from cannjax.transforms.parallel import DEFAULT_BUCKET_BYTES as DEFAULT_BUCKET_BYTES
from cannjax.transforms.parallel import DataParallelStep as DataParallelStep
from cannjax.transforms.parallel import StepOutput as StepOutput
from cannjax.transforms.parallel import all_reduce_mean as all_reduce_mean
from cannjax.transforms.parallel import collective_counts as collective_counts
from cannjax.transforms.parallel import data_mesh as data_mesh
from cannjax.transforms.parallel import data_parallel as data_parallel
from cannjax.transforms.parallel import initialize as initialize
from cannjax.transforms.parallel import plan_buckets as plan_buckets
from cannjax.transforms.parallel import replicate as replicate
from cannjax.transforms.parallel import shard_batch as shard_batch

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DataParallelStep",
    "StepOutput",
    "all_reduce_mean",
    "collective_counts",
    "data_mesh",
    "data_parallel",
    "initialize",
    "plan_buckets",
    "replicate",
    "shard_batch",
]
