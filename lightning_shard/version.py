"""The package's version, in a module of its own: ``lightning_shard/__init__.py`` re-exports it, and the checkpoint
writer records it without importing the package (which imports the strategies)."""

__version__ = "0.1.0"
