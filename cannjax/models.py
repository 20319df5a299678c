"""Small reference models: a GPT written with cannjax operators, its plain-JAX twin, and
the synthetic sorting task the demo trains on.
"""

from cannjax._src.models.gpt import GPTConfig as GPTConfig
from cannjax._src.models.gpt import GPTParams as GPTParams
from cannjax._src.models.gpt import gpt_logits as gpt_logits
from cannjax._src.models.gpt import gpt_loss as gpt_loss
from cannjax._src.models.gpt import init_gpt as init_gpt
from cannjax._src.models.gpt import plain_gpt_logits as plain_gpt_logits
from cannjax._src.models.gpt import plain_gpt_loss as plain_gpt_loss
from cannjax._src.models.tasks import Batch as Batch
from cannjax._src.models.tasks import SortTask as SortTask

__all__ = [
    "Batch",
    "GPTConfig",
    "GPTParams",
    "SortTask",
    "gpt_logits",
    "gpt_loss",
    "init_gpt",
    "plain_gpt_logits",
    "plain_gpt_loss",
]
