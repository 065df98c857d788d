"""attnlab: the Transformer and BERT in readable, fast PyTorch."""

from attnlab.errors import AttnlabError

__version__ = "0.1.0"
__all__ = ["AttnlabError", "__version__"]
