"""Optional integrations with other libraries. Each submodule imports its library when it is itself
imported; the core package never imports them.

* ``ssa_flash.integrations.transformers``: :func:`enable_ssa` for Hugging Face transformers models
  (``pip install ssa_flash[transformers]``).
"""
