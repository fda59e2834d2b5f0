"""Framework adapters: ``adapters.torch`` and ``adapters.jax`` (import the one you use)."""
