"""servetune: offline optimizer for the scheduling policy of LLM-serving engines."""

__version__ = "0.1.0"
