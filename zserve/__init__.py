"""zserve: shared, torch-free pieces that every tier needs (version, model catalog, process helpers)."""

__version__ = "0.1.0"
