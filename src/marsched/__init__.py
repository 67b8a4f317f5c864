"""marsched: MARS scheduling for augmented LLM requests, in a simulator and inside vLLM."""

__version__ = "0.1.0"
