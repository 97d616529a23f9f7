"""mt-ray: train LLMs at full precision on GPUs far smaller than the model."""

__version__ = "0.1.0"
