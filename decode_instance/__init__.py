"""The decode role (TetriInfer §3.4): receive prefilled sequences' KV, then continuous batching."""
