"""reviewer: review software repositories with simulated users.

This package is the orchestrator (the worker box). It must not import torch or backend/: it talks to the inference
backend only over HTTP.
"""

__version__ = "0.1.0"
