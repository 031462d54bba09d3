"""pith-ops: the kernels of MoE training (Triton, with a torch reference beside each).

Import from the module that holds what you need, e.g. `from pith_ops.swiglu import swiglu`.
"""
__version__ = "0.1.0"
