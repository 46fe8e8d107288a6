"""Tiers on other hosts: an engine host's registry and a gateway host's view of it (``engine_registry``), and the
control state every gateway host shares in Redis (``shared_state``)."""
