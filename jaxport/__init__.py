"""jaxport: PyTorch vision work moved to JAX, with proof that nothing changed on the way.

The JAX side. It never imports torch; the PyTorch side lives in `torch_compat`.
"""
__version__ = "0.1.0"
