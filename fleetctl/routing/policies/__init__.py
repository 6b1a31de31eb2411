"""Every routing policy but hardware-aware, one module each; routing/registry.py names them."""
