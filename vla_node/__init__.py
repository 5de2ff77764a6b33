"""vla-node: a real-time vision-language-action inference node."""

__version__ = "0.1.0"
