"""The governor daemon: runs the loop, manages the inference engine, exposes the control socket and CLI."""

__version__ = "0.1.0"
