"""Memory levers beyond recomputation."""
