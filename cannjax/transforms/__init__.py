"""Function transforms (floor 3): each module is one transform; public names are re-exported
from their own namespaces (``cannjax.amp``, ...)."""

from cannjax.transforms import amp as amp
from cannjax.transforms import loss_scale as loss_scale
from cannjax.transforms import precision as precision
