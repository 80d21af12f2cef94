"""The torch reference runner (:class:`TorchRunner`) and its layers (:mod:`.layers`).

Imports torch; ``import resin`` does not import this package.
"""

from resin.runners.torch.runner import TorchRunner

__all__ = ["TorchRunner"]
