"""torch_compat: the PyTorch side of jaxport (loading, conversion, cross-checks, optimizers)."""
