"""Small reference models: a GPT and a Llama-style decoder written with cannjax
operators, their plain-JAX twins, and the synthetic sorting task the demo trains on.
"""

from cannjax._src.models.gpt import GPTConfig as GPTConfig
from cannjax._src.models.gpt import GPTParams as GPTParams
from cannjax._src.models.gpt import gpt_logits as gpt_logits
from cannjax._src.models.gpt import gpt_loss as gpt_loss
from cannjax._src.models.gpt import init_gpt as init_gpt
from cannjax._src.models.gpt import plain_gpt_logits as plain_gpt_logits
from cannjax._src.models.gpt import plain_gpt_loss as plain_gpt_loss
from cannjax._src.models.llama import LlamaConfig as LlamaConfig
from cannjax._src.models.llama import LlamaLoRA as LlamaLoRA
from cannjax._src.models.llama import LlamaParams as LlamaParams
from cannjax._src.models.llama import init_llama as init_llama
from cannjax._src.models.llama import init_llama_lora as init_llama_lora
from cannjax._src.models.llama import llama_head as llama_head
from cannjax._src.models.llama import llama_hidden as llama_hidden
from cannjax._src.models.llama import llama_logits as llama_logits
from cannjax._src.models.llama import llama_loss as llama_loss
from cannjax._src.models.llama import plain_llama_hidden as plain_llama_hidden
from cannjax._src.models.llama import plain_llama_logits as plain_llama_logits
from cannjax._src.models.llama import plain_llama_loss as plain_llama_loss
from cannjax._src.models.tasks import Batch as Batch
from cannjax._src.models.tasks import SortTask as SortTask

__all__ = [
    "Batch",
    "GPTConfig",
    "GPTParams",
    "LlamaConfig",
    "LlamaLoRA",
    "LlamaParams",
    "SortTask",
    "gpt_logits",
    "gpt_loss",
    "init_gpt",
    "init_llama",
    "init_llama_lora",
    "llama_head",
    "llama_hidden",
    "llama_logits",
    "llama_loss",
    "plain_gpt_logits",
    "plain_gpt_loss",
    "plain_llama_hidden",
    "plain_llama_logits",
    "plain_llama_loss",
]
