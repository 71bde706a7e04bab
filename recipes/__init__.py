"""Bundled YAML recipes (see `slipstream recipes`)."""
