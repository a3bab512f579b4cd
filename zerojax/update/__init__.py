"""The managed update: what zerojax wraps around any optax transformation."""
