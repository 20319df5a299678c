"""Data-parallel gradient synchronization over a mesh axis, single host or multi-process,
and parameter shardings for FSDP and tensor parallelism (``docs/parallel.md``).
"""

from cannjax._src.core.partitioned import placed_like as placed_like
from cannjax._src.parallel.buckets import DEFAULT_BUCKET_BYTES as DEFAULT_BUCKET_BYTES
from cannjax._src.parallel.buckets import all_reduce_mean as all_reduce_mean
from cannjax._src.parallel.buckets import plan_buckets as plan_buckets
from cannjax._src.parallel.distributed import initialize as initialize
from cannjax._src.parallel.hlo import collective_bytes as collective_bytes
from cannjax._src.parallel.hlo import collective_counts as collective_counts
from cannjax._src.parallel.mesh import data_mesh as data_mesh
from cannjax._src.parallel.mesh import replicate as replicate
from cannjax._src.parallel.mesh import shard_batch as shard_batch
from cannjax._src.parallel.ring_attention import ring_attention as ring_attention
from cannjax._src.parallel.sharding import fsdp as fsdp
from cannjax._src.parallel.sharding import model_mesh as model_mesh
from cannjax._src.parallel.sharding import param_shardings as param_shardings
from cannjax._src.parallel.sharding import tensor_parallel as tensor_parallel
from cannjax._src.parallel.step import DataParallelStep as DataParallelStep
from cannjax._src.parallel.step import StepOutput as StepOutput
from cannjax._src.parallel.step import data_parallel as data_parallel

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DataParallelStep",
    "StepOutput",
    "all_reduce_mean",
    "collective_bytes",
    "collective_counts",
    "data_mesh",
    "data_parallel",
    "fsdp",
    "initialize",
    "model_mesh",
    "param_shardings",
    "placed_like",
    "plan_buckets",
    "replicate",
    "ring_attention",
    "shard_batch",
    "tensor_parallel",
]
