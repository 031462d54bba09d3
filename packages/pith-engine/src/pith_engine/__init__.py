"""pith-engine: MoE sequencing, parallelism, optimizer and checkpoints on top of pith-ops."""
__version__ = "0.1.0"
