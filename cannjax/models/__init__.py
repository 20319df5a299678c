"""Small reference models written with cannjax operators, and their plain-JAX twins."""

from cannjax.models.gpt import GPTConfig as GPTConfig
from cannjax.models.gpt import GPTParams as GPTParams
from cannjax.models.gpt import gpt_logits as gpt_logits
from cannjax.models.gpt import gpt_loss as gpt_loss
from cannjax.models.gpt import init_gpt as init_gpt
from cannjax.models.gpt import plain_gpt_logits as plain_gpt_logits
from cannjax.models.gpt import plain_gpt_loss as plain_gpt_loss

__all__ = [
    "GPTConfig",
    "GPTParams",
    "gpt_logits",
    "gpt_loss",
    "init_gpt",
    "plain_gpt_logits",
    "plain_gpt_loss",
]
